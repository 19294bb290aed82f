"""``compile-check --mesh`` on deviceless multi-chip TPU topologies: sharded kernels compile on
every chip with the collectives their rule implies, and the negative control (the same function
on an Auto mesh, where no rule applies) is refused by Mosaic. CI compiles every kernel case on
v5e and rms_norm on all four generations; ``kernel-hub compile-check --mesh --all`` runs the rest.
"""

from __future__ import annotations

import pytest

from kernel_hub.bench.mesh_compile import (
    CONTROL,
    compile_mesh_case,
    count_collectives,
    kernel_mesh_cases,
)
from kernel_hub.topologies import DEFAULT_GENERATIONS


def _cells():
    cells = []
    for op in ("rmsnorm", "attention", "moe-gemm"):
        kernel, cases = kernel_mesh_cases(op)
        for case in cases:
            ring_backward = "ring" in case.name  # 20-30 s a cell: left to the CLI run
            generations = DEFAULT_GENERATIONS if op == "rmsnorm" else ("v5e",)
            directions = ["forward"]
            if case.differentiable and not ring_backward:
                directions.append("backward")
            if case.control:
                directions.append(CONTROL)
            cells += [
                pytest.param(kernel, case, g, d, id=f"{kernel}-{case.name}-{d}-{g}")
                for d in directions
                for g in (generations if d != CONTROL else ("v5e",))
            ]
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
@pytest.mark.parametrize(("kernel", "case", "generation", "direction"), _cells())
def test_mesh_cell(kernel, case, generation, direction) -> None:
    result = compile_mesh_case(kernel, case, generation, direction)
    assert result.ok, result.to_json()
    if direction == CONTROL:
        assert "cannot be automatically partitioned" in result.error
