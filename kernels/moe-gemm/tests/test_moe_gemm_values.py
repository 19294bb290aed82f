"""Value parity of gmm / tgmm (pallas in interpret mode, tokamax, xla) with a float64 oracle."""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import moe_gemm_oracle as oracle
import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kernel_hub import get_kernel

moe = get_kernel("moe-gemm")

IMPLEMENTATIONS = ("pallas", "tokamax", "xla", "xla_loop")
DTYPES = ("float32", "bfloat16")
# One shape for the property tests: 37 rows (not a multiple of any tile), 5 groups.
ROWS, K, N, GROUPS = 37, 16, 24, 5


def split(draw_cuts: list[int], total: int) -> list[int]:
    cuts = sorted(min(c, total) for c in draw_cuts)
    return [b - a for a, b in itertools.pairwise([0, *cuts, total])]


@st.composite
def group_sizes(draw, rows: int = ROWS, groups: int = GROUPS) -> list[int]:
    """Sizes summing to at most ``rows``: empty groups, a huge group and a short sum included."""
    total = draw(st.sampled_from([rows, rows, rows - 1, rows // 2, 0]))
    cuts = draw(st.lists(st.integers(0, rows), min_size=groups - 1, max_size=groups - 1))
    return split(cuts, total)


def _inputs(dtype: str, transpose_rhs: bool, seed: int = 0, rows=ROWS, k=K, n=N, groups=GROUPS):
    rng = np.random.default_rng(seed)
    lhs = jnp.asarray(rng.standard_normal((rows, k)), dtype)
    shape = (groups, n, k) if transpose_rhs else (groups, k, n)
    rhs = jnp.asarray(rng.standard_normal(shape), dtype)
    return lhs, rhs


@functools.cache
def _jitted_gmm(implementation: str, transpose_rhs: bool, tiling=None):
    return jax.jit(
        functools.partial(
            moe.jax.gmm, transpose_rhs=transpose_rhs, implementation=implementation, tiling=tiling
        )
    )


@functools.cache
def _jitted_tgmm(implementation: str, tiling=None):
    return jax.jit(functools.partial(moe.jax.tgmm, implementation=implementation, tiling=tiling))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_gmm_matches_oracle_over_group_sizes(implementation, dtype, transpose_rhs):
    lhs, rhs = _inputs(dtype, transpose_rhs)
    gmm = _jitted_gmm(implementation, transpose_rhs)

    @settings(max_examples=12, deadline=None)
    @given(sizes=group_sizes())
    @example(sizes=[0, 0, ROWS, 0, 0])
    @example(sizes=[ROWS, 0, 0, 0, 0])
    @example(sizes=[0, 0, 0, 0, 0])
    @example(sizes=[1, 1, 1, 1, 1])
    def check(sizes):
        out = gmm(lhs, rhs, jnp.asarray(sizes, jnp.int32))
        assert out.dtype == lhs.dtype
        oracle.assert_close(
            out,
            oracle.gmm(lhs, rhs, sizes, transpose_rhs),
            dtype,
            f"gmm[{implementation}] sizes={sizes}",
        )

    check()


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_tgmm_matches_oracle_over_group_sizes(implementation, dtype):
    lhs, grad = _inputs(dtype, transpose_rhs=False)[0], _inputs(dtype, False, seed=1, k=N)[0]
    tgmm = _jitted_tgmm(implementation)

    @settings(max_examples=12, deadline=None)
    @given(sizes=group_sizes())
    @example(sizes=[0, ROWS, 0, 0, 0])
    @example(sizes=[0, 0, 0, 0, 0])
    def check(sizes):
        out = tgmm(lhs, grad, jnp.asarray(sizes, jnp.int32))
        assert out.shape == (GROUPS, K, N)
        oracle.assert_close(
            out, oracle.tgmm(lhs, grad, sizes), dtype, f"tgmm[{implementation}] sizes={sizes}"
        )

    check()


# Shapes around tile edges, run through the Pallas kernel with small explicit row tiles so one
# call has several tiles, groups straddling tile edges and a ragged last tile.
EDGE_CASES = [
    # rows, k, n, sizes, tile rows
    pytest.param(37, 16, 24, [5, 0, 20, 3, 9], 8, id="ragged-last-tile"),
    pytest.param(3, 8, 8, [1, 0, 0, 1, 0, 0, 1, 0], 8, id="rows-fewer-than-groups"),
    pytest.param(1, 8, 8, [0, 1, 0], 8, id="single-row"),
    pytest.param(40, 8, 16, [0, 40], 16, id="one-group-many-tiles"),
    pytest.param(24, 8, 8, [7, 2, 6], 8, id="sum-below-rows"),
]


@pytest.mark.parametrize(("rows", "k", "n", "sizes", "tm"), EDGE_CASES)
@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_pallas_tiles_with_group_edges_inside(rows, k, n, sizes, tm, transpose_rhs):
    groups = len(sizes)
    lhs, rhs = _inputs("float32", transpose_rhs, rows=rows, k=k, n=n, groups=groups)
    tiling = moe.tiling.Tiling(tm, k, n)
    gs = jnp.asarray(sizes, jnp.int32)
    out = moe.jax.gmm(
        lhs, rhs, gs, transpose_rhs=transpose_rhs, implementation="pallas", tiling=tiling
    )
    oracle.assert_close(out, oracle.gmm(lhs, rhs, sizes, transpose_rhs), "float32", "gmm")
    grad = _inputs("float32", False, seed=2, rows=rows, k=n)[0]
    out = moe.jax.tgmm(lhs, grad, gs, implementation="pallas", tiling=tiling)
    oracle.assert_close(out, oracle.tgmm(lhs, grad, sizes), "float32", "tgmm")


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_preferred_element_type_sets_output_dtype(implementation):
    lhs, rhs = _inputs("bfloat16", transpose_rhs=True)
    sizes = [10, 0, 20, 7, 0]
    out = moe.jax.gmm(
        lhs,
        rhs,
        jnp.asarray(sizes, jnp.int32),
        transpose_rhs=True,
        preferred_element_type=jnp.float32,
        implementation=implementation,
    )
    assert out.dtype == jnp.float32
    # An f32 result of bf16 inputs is not rounded to bf16: it matches the oracle much closer.
    oracle.assert_close(out, oracle.gmm(lhs, rhs, sizes, True), "float32", "gmm f32 out")


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_empty_dimensions_give_empty_or_zero_results(implementation):
    gs = jnp.asarray([0, 0], jnp.int32)
    out = moe.jax.gmm(jnp.zeros((0, 8)), jnp.ones((2, 8, 16)), gs, implementation=implementation)
    assert out.shape == (0, 16)
    grads = moe.jax.tgmm(jnp.zeros((0, 8)), jnp.zeros((0, 16)), gs, implementation=implementation)
    assert grads.shape == (2, 8, 16) and not np.any(np.asarray(grads))


def test_torch_op_takes_a_torch_preferred_element_type():
    lhs, rhs = _inputs("bfloat16", transpose_rhs=True)
    sizes = [10, 0, 20, 7, 0]
    to_torch = lambda a: torch.from_numpy(np.asarray(a, np.float32)).bfloat16()
    out = moe.gmm(
        to_torch(lhs), to_torch(rhs), torch.tensor(sizes, dtype=torch.int32), True, torch.float32
    )
    assert out.dtype == torch.float32
    oracle.assert_close(out.numpy(), oracle.gmm(lhs, rhs, sizes, True), "float32", "torch op")
