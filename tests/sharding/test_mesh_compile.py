"""``compile-check --mesh`` on deviceless multi-chip TPU topologies: sharded kernels compile under
plain ``jit`` on every chip with the collectives their rule implies, on Explicit meshes and on
Auto meshes (no ``use_mesh``: the boundary places inputs by the mesh-axis conventions), and the
negative control (the same function on an Auto mesh with the boundary bypassed) is refused by
Mosaic. CI compiles every registry kernel's mesh cases forward and (where differentiable)
backward on both mesh kinds (a backward that is XLA's on Auto meshes only): the cheap per-op
kernels (norms, attention, paged decode, gated MLP, conv1d, rotary) on all four generations'
Auto meshes, every other case on v5e; ``kernel-hub compile-check --mesh --all`` runs the rest.
"""

from __future__ import annotations

import math
import re

import pytest

from kernel_hub.bench.mesh_compile import (
    CONTROL,
    MESH_KINDS,
    cell_problems,
    collective_shapes,
    compile_mesh_case,
    compiled_hlo,
    count_collectives,
    kernel_mesh_cases,
)
from kernel_hub.registry.registry import load_registry
from kernel_hub.topologies import DEFAULT_GENERATIONS

ALL_GENERATIONS = (
    "rmsnorm",
    "layernorm",
    "attention",
    "ragged-attention",
    "gated-mlp",
    "causal-conv1d",
    "rotary",
)
"""Ops whose plain kernel cases compile on every generation (cheap, 0.1-2 s a cell); the loss's
vocabulary-parallel case does in its own test below. Backwards that are XLA's (the scans': 3-13 s
a cell) compile on the Auto mesh only."""


VOCAB_PARALLEL_CELLS = [*((g, "auto") for g in DEFAULT_GENERATIONS), ("v5e", "explicit")]
"""(generation, mesh kind) of the vocabulary-parallel loss's forward and backward cells: they
compile in ``test_vocab_parallel_loss_moves_token_vectors_not_the_head``, which checks them as
``test_mesh_cell`` would and reads the collectives' shapes, so ``_cells`` leaves them out."""


def _vocab_parallel(case) -> bool:
    return case.name.startswith("vocab-parallel")


KERNEL_OPS = sorted({entry.kernel: op for op, entry in load_registry().ops.items()}.values())
"""One op name per registry kernel (a kernel's mesh cases cover all its ops)."""


def test_every_registry_kernel_has_mesh_cases() -> None:
    missing = [op for op in KERNEL_OPS if not kernel_mesh_cases(op)[1]]
    assert not missing, f"kernels of {missing} declare no mesh_cases (see kernel_hub.sharding)"


def _cells():
    cells = []
    for op in KERNEL_OPS:
        kernel, cases = kernel_mesh_cases(op)
        for case in cases:
            layer = not case.control  # ring / EP layers: 4-30 s a cell, forward on v5e here
            cheap = op in ALL_GENERATIONS and not layer and "ragged GQA" not in case.name
            for kind in MESH_KINDS:
                generations = DEFAULT_GENERATIONS if cheap and kind == "auto" else ("v5e",)
                if _vocab_parallel(case):
                    generations = [g for g in generations if (g, kind) not in VOCAB_PARALLEL_CELLS]
                directions = ["forward"]
                if case.differentiable and not layer and (kind == "auto" or not case.xla_backward):
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


def _elements(shape_text: str) -> int:
    """Elements of a collective's result (a tuple's largest member)."""
    dims = re.findall(r"\w+\[([\d,]*)\]", shape_text)
    return max(math.prod(int(d) for d in ds.split(",") if d) for ds in dims)


def test_collective_shapes_reads_results_and_tuples() -> None:
    hlo = (
        "%a = f32[1024]{0} all-reduce(%x), channel_id=1\n"
        "%b = (f32[1024]{0}, f32[]{:T(128)}) all-reduce-start(%y, %z)\n"
        "%c = bf16[8,512]{1,0} all-gather(%w)"
    )
    shapes = collective_shapes(hlo)
    assert [c for c, _ in shapes] == ["all-reduce", "all-reduce", "all-gather"]
    assert [_elements(s) for _, s in shapes] == [1024, 1024, 8 * 512]


@pytest.mark.slow
@pytest.mark.tpu_compile
@pytest.mark.parametrize(("generation", "kind"), VOCAB_PARALLEL_CELLS)
def test_vocab_parallel_loss_moves_token_vectors_not_the_head(generation: str, kind: str) -> None:
    """Plain jit (Auto mesh: the vocabulary over ``model`` by convention): the forward's only
    collectives are all-reduces of per-token vectors (the log-sum-exp's max and sums); the
    backward adds hidden's gradient summed over the vocabulary shards and the head's over the
    token shards; the weight is never gathered. Each program also passes ``test_mesh_cell``'s
    check (Mosaic kernels, the case's collectives): these are that test's cells for this case
    (its control stays there)."""
    _, cases = kernel_mesh_cases("linear-cross-entropy")
    case = next(c for c in cases if _vocab_parallel(c))
    (tokens, hidden), (vocab, _) = case.args[0].shape, case.args[1].shape
    programs = {d: compiled_hlo(case, generation, d, kind) for d in ("forward", "backward")}
    for direction, hlo in programs.items():
        problems = cell_problems(case, direction, kind, count_collectives(hlo))
        assert not problems, f"{direction}: {problems}"
    forward = collective_shapes(programs["forward"])
    assert forward, "no collective: the vocabulary was not split"
    assert {c for c, _ in forward} == {"all-reduce"}, forward
    assert all(_elements(s) <= tokens for _, s in forward), forward
    backward = collective_shapes(programs["backward"])
    assert {c for c, _ in backward} == {"all-reduce"}, backward
    assert max(_elements(s) for _, s in backward) < vocab * hidden, backward
