"""Pallas grouped matmuls for TPU: ``gmm`` (per-group ``lhs @ rhs[g]``) and ``tgmm``
(per-group ``lhs^T @ grad``). ``vjp.py`` differentiates each with the other.

Both walk a grid of "visits" (see ``schedule.py``) handed in as scalar prefetch: group boundaries
may fall anywhere inside a row tile, so a tile shared by two groups is visited once per group and
each visit masks the rows that are not its group's. An f32 accumulator in VMEM carries a result
across the visits and contraction steps that share an output block; the block is written when
the next grid step moves to another one.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernel_hub.kernel_api import tiling as tpu_tiling

from .reference import accumulator_dtype
from .schedule import Schedule, cdiv, gmm_schedule, num_visits, tgmm_schedule
from .tiling import Tiling, default_tiling


def _precision(dtype):
    # f32 operands: full-precision passes on the MXU, matching XLA's f32 results.
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype).itemsize >= 4 else None


def _row_mask(tile, tile_rows: int, start, end):
    """[tile_rows, 1]: which rows of this row tile lie in [start, end)."""
    rows = tile * tile_rows + jax.lax.broadcasted_iota(jnp.int32, (tile_rows, 1), 0)
    return (rows >= start) & (rows < end)


def _gmm_kernel(
    tiles, groups, starts, ends, lhs_ref, rhs_ref, out_ref, acc_ref, *, transpose_rhs: bool
):
    visit, k_step = pl.program_id(1), pl.program_id(2)
    last_visit, last_k = pl.num_programs(1) - 1, pl.num_programs(2) - 1
    tile = tiles[visit]
    first_of_tile = (visit == 0) | (tiles[jnp.maximum(visit - 1, 0)] != tile)
    last_of_tile = (visit == last_visit) | (tiles[jnp.minimum(visit + 1, last_visit)] != tile)
    start, end = starts[visit], ends[visit]

    @pl.when(first_of_tile & (k_step == 0))
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(start < end)
    def _():
        contract = 1 if transpose_rhs else 0
        product = jax.lax.dot_general(
            lhs_ref[...],
            rhs_ref[...],
            (((1,), (contract,)), ((), ())),
            precision=_precision(lhs_ref.dtype),
            preferred_element_type=acc_ref.dtype,
        )
        mask = _row_mask(tile, acc_ref.shape[0], start, end)
        acc_ref[...] += jnp.where(mask, product, 0)

    @pl.when(last_of_tile & (k_step == last_k))
    def _():
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def _gmm_call(lhs, rhs, group_sizes, *, transpose_rhs, out_dtype, tiling: Tiling, interpret):
    m, k = lhs.shape
    num_groups = rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    tm, tk, tn = tiling.tm, tiling.tk, tiling.tn
    k_steps = k // tk
    schedule = gmm_schedule(group_sizes, m, tm)
    visits = num_visits(m, num_groups, tm)

    def k_block(v, kk, starts, ends):
        # Empty visits keep the last contraction block, so they copy nothing new.
        return jnp.where(starts[v] < ends[v], kk, k_steps - 1)

    def lhs_map(j, v, kk, tiles, groups, starts, ends):
        return tiles[v], k_block(v, kk, starts, ends)

    def rhs_map(j, v, kk, tiles, groups, starts, ends):
        kb = k_block(v, kk, starts, ends)
        return (groups[v], j, kb) if transpose_rhs else (groups[v], kb, j)

    def out_map(j, v, kk, tiles, groups, starts, ends):
        return tiles[v], j

    rhs_block = (None, tn, tk) if transpose_rhs else (None, tk, tn)
    itemsize = lhs.dtype.itemsize
    cost = pl.CostEstimate(
        flops=2 * m * k * n,
        transcendentals=0,
        bytes_accessed=(m * k * cdiv(n, tn) + num_groups * k * n) * itemsize
        + m * n * jnp.dtype(out_dtype).itemsize,
    )
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(Schedule._fields),
        grid=(cdiv(n, tn), visits, k_steps),
        in_specs=[pl.BlockSpec((tm, tk), lhs_map), pl.BlockSpec(rhs_block, rhs_map)],
        out_specs=pl.BlockSpec((tm, tn), out_map),
        scratch_shapes=[pltpu.VMEM((tm, tn), accumulator_dtype(lhs.dtype))],
    )
    return pl.pallas_call(
        functools.partial(_gmm_kernel, transpose_rhs=transpose_rhs),
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid_spec=grid_spec,
        compiler_params=tpu_tiling.compiler_params("parallel", "arbitrary", "arbitrary"),
        cost_estimate=cost,
        interpret=interpret,
        name="moe_gmm",
    )(*schedule, lhs, rhs)


def _tgmm_kernel(tiles, groups, starts, ends, lhs_ref, grad_ref, out_ref, acc_ref):
    visit, last_visit = pl.program_id(2), pl.num_programs(2) - 1
    group = groups[visit]
    first_of_group = (visit == 0) | (groups[jnp.maximum(visit - 1, 0)] != group)
    last_of_group = (visit == last_visit) | (groups[jnp.minimum(visit + 1, last_visit)] != group)
    start, end = starts[visit], ends[visit]

    @pl.when(first_of_group)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(start < end)
    def _():
        # Rows outside the group, and rows past m in a ragged last tile, must not reach the sum.
        mask = _row_mask(tiles[visit], lhs_ref.shape[0], start, end)
        lhs = jnp.where(mask, lhs_ref[...], 0)
        grad = jnp.where(mask, grad_ref[...], 0)
        acc_ref[...] += jax.lax.dot_general(
            lhs,
            grad,
            (((0,), (0,)), ((), ())),
            precision=_precision(lhs_ref.dtype),
            preferred_element_type=acc_ref.dtype,
        )

    @pl.when(last_of_group)
    def _():
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def _tgmm_call(lhs, grad, group_sizes, *, out_dtype, tiling: Tiling, interpret):
    m, k = lhs.shape
    n = grad.shape[1]
    num_groups = group_sizes.shape[0]
    tm, tk, tn = tiling.tm, tiling.tk, tiling.tn
    schedule = tgmm_schedule(group_sizes, m, tm)
    visits = num_visits(m, num_groups, tm)

    def lhs_map(i, j, v, tiles, groups, starts, ends):
        return tiles[v], i

    def grad_map(i, j, v, tiles, groups, starts, ends):
        return tiles[v], j

    def out_map(i, j, v, tiles, groups, starts, ends):
        return groups[v], i, j

    itemsize = lhs.dtype.itemsize
    cost = pl.CostEstimate(
        flops=2 * m * k * n,
        transcendentals=0,
        bytes_accessed=(m * k * cdiv(n, tn) + m * n * cdiv(k, tk)) * itemsize
        + num_groups * k * n * jnp.dtype(out_dtype).itemsize,
    )
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(Schedule._fields),
        grid=(cdiv(k, tk), cdiv(n, tn), visits),
        in_specs=[pl.BlockSpec((tm, tk), lhs_map), pl.BlockSpec((tm, tn), grad_map)],
        out_specs=pl.BlockSpec((None, tk, tn), out_map),
        scratch_shapes=[pltpu.VMEM((tk, tn), accumulator_dtype(lhs.dtype))],
    )
    return pl.pallas_call(
        _tgmm_kernel,
        out_shape=jax.ShapeDtypeStruct((num_groups, k, n), out_dtype),
        grid_spec=grid_spec,
        compiler_params=tpu_tiling.compiler_params("parallel", "parallel", "arbitrary"),
        cost_estimate=cost,
        interpret=interpret,
        name="moe_tgmm",
    )(*schedule, lhs, grad)


def gmm(
    lhs, rhs, group_sizes, *, transpose_rhs: bool, out_dtype, tiling: Tiling | None, interpret: bool
):
    """``out[rows of g] = lhs[rows of g] @ rhs[g]`` (``rhs[g].T`` if ``transpose_rhs``).

    Not differentiable by itself (``vjp.py`` differentiates it); ``tiling=None``: the default.
    """
    m, k = lhs.shape
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    tiling = tiling or default_tiling(
        "gmm", m, k, n, rhs.shape[0], lhs.dtype, out_dtype, interpret=interpret
    )
    return _gmm_call(
        lhs,
        rhs,
        group_sizes,
        transpose_rhs=transpose_rhs,
        out_dtype=out_dtype,
        tiling=tiling,
        interpret=interpret,
    )


def tgmm(lhs, grad, group_sizes, *, out_dtype, tiling: Tiling | None, interpret: bool):
    """``out[g] = lhs[rows of g].T @ grad[rows of g]``; groups without rows give zeros."""
    (m, k), n = lhs.shape, grad.shape[1]
    tiling = tiling or default_tiling(
        "tgmm", m, k, n, group_sizes.shape[0], lhs.dtype, out_dtype, interpret=interpret
    )
    return _tgmm_call(
        lhs, grad, group_sizes, out_dtype=out_dtype, tiling=tiling, interpret=interpret
    )
