"""``compile-check --mesh`` on deviceless multi-chip TPU topologies: sharded kernels compile under
plain ``jit`` on every chip with the collectives their rule implies, on Explicit meshes and on
Auto meshes (no ``use_mesh``: the boundary places inputs by the mesh-axis conventions), and the
negative control (the same function on an Auto mesh with the boundary bypassed) is refused by
Mosaic. CI compiles the per-op kernels (norms, attention, paged decode) forward and backward on
Auto meshes of all four generations, every other case on v5e; ``kernel-hub compile-check --mesh
--all`` runs the rest.
"""

from __future__ import annotations

import pytest

from kernel_hub.bench.mesh_compile import (
    CONTROL,
    MESH_KINDS,
    compile_mesh_case,
    count_collectives,
    kernel_mesh_cases,
)
from kernel_hub.topologies import DEFAULT_GENERATIONS

ALL_GENERATIONS = ("rmsnorm", "layernorm", "attention", "ragged-attention")
"""Ops whose plain kernel cases compile on every generation (cheap, 0.3-2 s a cell)."""


def _cells():
    cells = []
    for op in ("rmsnorm", "layernorm", "attention", "ragged-attention", "moe-gemm", "fused-moe"):
        kernel, cases = kernel_mesh_cases(op)
        for case in cases:
            layer = not case.control  # ring / EP layers: 4-30 s a cell, forward on v5e here
            cheap = op in ALL_GENERATIONS and not layer and "ragged GQA" not in case.name
            for kind in MESH_KINDS:
                generations = DEFAULT_GENERATIONS if cheap and kind == "auto" else ("v5e",)
                directions = ["forward"]
                if case.differentiable and not layer:
                    directions.append("backward")
                cells += [
                    pytest.param(
                        kernel, case, g, d, kind, id=f"{kernel}-{case.name}-{d}-{kind}-{g}"
                    )
                    for d in directions
                    for g in generations
                ]
            if case.control:
                cells.append(
                    pytest.param(
                        kernel, case, "v5e", CONTROL, "auto", id=f"{kernel}-{case.name}-control"
                    )
                )
    return cells


def test_count_collectives_reads_async_starts_once() -> None:
    hlo = (
        "%a = all-reduce-start(%x)\n%b = all-reduce-done(%a)\n%c = ragged-all-to-all(%y)\n"
        '%d = all-to-all(%z)\n%e = custom-call(%w), custom_call_target="tpu_custom_call"'
    )
    assert count_collectives(hlo) == {
        "all-reduce": 1,
        "ragged-all-to-all": 1,
        "all-to-all": 1,
        "mosaic": 1,
    }


@pytest.mark.slow
@pytest.mark.tpu_compile
@pytest.mark.parametrize(("kernel", "case", "generation", "direction", "kind"), _cells())
def test_mesh_cell(kernel, case, generation, direction, kind) -> None:
    result = compile_mesh_case(kernel, case, generation, direction, kind)
    assert result.ok, result.to_json()
    if direction == CONTROL:
        assert "cannot be automatically partitioned" in result.error
