"""Default TPU tilings obey the block rules and the VMEM budget for every benchmark shape."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from kernel_hub import get_kernel
from kernel_hub.errors import NoImplementationError

moe = get_kernel("moe-gemm")


def _calls(case):
    """(kind, m, k, n) of the forward gmm and the backward kernels of a benchmark case
    (``gmm_quantized``: the activations' gradient only)."""
    lhs, rhs = case.args[:2]
    m, k = lhs.shape
    n = rhs.shape[1] if case.kwargs.get("transpose_rhs") else rhs.shape[2]
    if case.fn is moe.jax.gmm_quantized:
        return [("gmm", m, k, n), ("gmm", m, n, k)]
    return [("gmm", m, k, n), ("gmm", m, n, k), ("tgmm", m, k, n)]


def test_default_tilings_are_legal_and_fit():
    tiling = moe.tiling
    checked = 0
    for case in moe.benchmark.CASES:
        lhs, rhs = case.args[:2]
        for kind, m, k, n in _calls(case):
            chosen = tiling.default_tiling(
                kind, m, k, n, rhs.shape[0], lhs.dtype, lhs.dtype, interpret=False
            )
            where = f"{case.name} {kind} m={m} k={k} n={n}: {chosen}"
            assert tiling.tiling_problem(kind, m, k, n, lhs.dtype, chosen) is None, where
            assert tiling.vmem_bytes(kind, chosen, lhs.dtype, lhs.dtype) <= (
                tiling.VMEM_BUDGET_BYTES
            ), where
            checked += 1
    assert checked == sum(len(_calls(case)) for case in moe.benchmark.CASES)


@pytest.mark.parametrize(
    ("m", "tile", "problem"),
    [(64, 16, None), (64, 64, None), (37, 37, None), (64, 24, "tm=24"), (64, 8, "tm=8")],
)
def test_row_tiles_follow_the_bf16_sublane_rule(m, tile, problem):
    tiling = moe.tiling
    found = tiling.tiling_problem("gmm", m, 256, 256, "bfloat16", tiling.Tiling(tile, 256, 256))
    assert (found is None) if problem is None else (problem in found)


def test_tiling_problems_name_the_rule():
    problem = moe.tiling.tiling_problem(
        "gmm", 64, 256, 256, jnp.bfloat16, moe.tiling.Tiling(24, 200, 256)
    )
    assert "tm=24 must equal the dimension (64) or be a multiple of 16" in problem
    assert "tk=200" in problem and "must divide k=256" in problem


@pytest.mark.parametrize("tk", [96, 384])
def test_a_ragged_contraction_tiling_is_refused_in_interpret_mode_too(tk):
    """Interpret mode has no TPU block rules, but a tk that does not divide k would drop (or
    read past) part of the contraction there as well."""
    x, w = jnp.ones((8, 256), jnp.float32), jnp.ones((4, 256, 128), jnp.float32)
    sizes = jnp.asarray([4, 4, 0, 0], jnp.int32)
    tiling = moe.tiling.Tiling(8, tk, 128)
    with pytest.raises(NoImplementationError, match=rf"tk={tk} must divide k=256"):
        moe.jax.gmm(x, w, sizes, implementation="pallas", tiling=tiling)
    assert moe.jax.gmm(
        x, w, sizes, implementation="pallas", tiling=moe.tiling.Tiling(8, 128, 128)
    ).shape == (8, 128)
