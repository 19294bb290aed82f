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
from kernel_hub.kernel_api import weight_formats

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


def _quantized_product(lhs, w, scale, *, transpose_rhs: bool, quantization: str, blocks):
    """``lhs @ W^T`` (``transpose_rhs``: the forward, contracting ``in``) or ``lhs @ W`` (the
    gradient of the activations, contracting ``out``) of one stored [out, in] quantized weight
    block, in f32: the weight converted to the activation dtype (exact for int8 and e4m3) and
    its scales applied in VMEM. int8 scales multiply the product's output columns (forward) or
    the contraction's columns of ``lhs`` (gradient, rounded to the activation dtype as a
    dequantized weight would be); fp8 block scales multiply each 128-wide contraction slice's
    partial product. ``blocks``: (first output block, first input block) of this weight block."""
    precision = _precision(lhs.dtype)
    contract = 1 if transpose_rhs else 0
    dims = (((1,), (contract,)), ((), ()))
    acc = accumulator_dtype(lhs.dtype)
    w = w.astype(lhs.dtype)
    if quantization == "int8":
        if transpose_rhs:
            product = jax.lax.dot_general(
                lhs, w, dims, precision=precision, preferred_element_type=acc
            )
            return product * scale.astype(acc)
        lhs = (lhs.astype(acc) * scale.astype(acc)).astype(lhs.dtype)
        return jax.lax.dot_general(lhs, w, dims, precision=precision, preferred_element_type=acc)
    k, block = lhs.shape[1], weight_formats.FP8_BLOCK
    out_width = w.shape[0] if transpose_rhs else w.shape[1]
    out_first, in_first = blocks
    if transpose_rhs:
        scales = weight_formats.fp8_block_scales(
            scale, out_first, out_width // block, in_first, k // block, contract_out=False
        )
    else:
        scales = weight_formats.fp8_block_scales(
            scale, out_first, k // block, in_first, out_width // block, contract_out=True
        )
    product = None
    for s in range(k // block):
        cols = slice(s * block, (s + 1) * block)
        w_part = w[:, cols] if transpose_rhs else w[cols, :]
        part = jax.lax.dot_general(
            lhs[:, cols], w_part, dims, precision=precision, preferred_element_type=acc
        )
        part = part * scales[s : s + 1, :].astype(acc)
        product = part if product is None else product + part
    return product


def _gmm_kernel(
    tiles,
    groups,
    starts,
    ends,
    lhs_ref,
    rhs_ref,
    *refs,
    transpose_rhs: bool,
    quantization: str | None,
):
    scale_ref, out_ref, acc_ref = refs if quantization else (None, *refs)
    j, visit, k_step = pl.program_id(0), pl.program_id(1), pl.program_id(2)
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
        if quantization:
            tk, tn = lhs_ref.shape[1], out_ref.shape[1]
            block = weight_formats.FP8_BLOCK
            k_first, n_first = k_step * (tk // block), j * (tn // block)
            product = _quantized_product(
                lhs_ref[...],
                rhs_ref[...],
                scale_ref[...],
                transpose_rhs=transpose_rhs,
                quantization=quantization,
                blocks=(n_first, k_first) if transpose_rhs else (k_first, n_first),
            )
        else:
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


def _gmm_call(
    lhs,
    rhs,
    group_sizes,
    *,
    transpose_rhs,
    out_dtype,
    tiling: Tiling,
    interpret,
    scale=None,
    quantization: str | None = None,
):
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

    def channel_scale_map(j, v, kk, tiles, groups, starts, ends):
        # int8 scales follow the weight's output channels: this block's columns (forward) or
        # its contraction rows (gradient)
        return groups[v], 0, j if transpose_rhs else k_block(v, kk, starts, ends)

    def expert_scale_map(j, v, kk, tiles, groups, starts, ends):
        return groups[v], 0, 0

    rhs_block = (None, tn, tk) if transpose_rhs else (None, tk, tn)
    in_specs = [pl.BlockSpec((tm, tk), lhs_map), pl.BlockSpec(rhs_block, rhs_map)]
    operands = [lhs, rhs]
    scale_bytes = 0
    if quantization == "int8":  # kernel layout [E, 1, out]
        in_specs.append(pl.BlockSpec((None, 1, tn if transpose_rhs else tk), channel_scale_map))
        operands.append(scale)
    elif quantization == "fp8":  # the whole expert's raw block scales (1/16384 of its weights)
        in_specs.append(pl.BlockSpec((None, *scale.shape[1:]), expert_scale_map))
        operands.append(scale)
    if scale is not None:
        scale_bytes = scale.size * scale.dtype.itemsize
    itemsize = lhs.dtype.itemsize
    cost = pl.CostEstimate(
        flops=2 * m * k * n,
        transcendentals=0,
        bytes_accessed=m * k * cdiv(n, tn) * itemsize
        + num_groups * k * n * rhs.dtype.itemsize
        + scale_bytes
        + m * n * jnp.dtype(out_dtype).itemsize,
    )
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(Schedule._fields),
        grid=(cdiv(n, tn), visits, k_steps),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((tm, tn), out_map),
        scratch_shapes=[pltpu.VMEM((tm, tn), accumulator_dtype(lhs.dtype))],
    )
    return pl.pallas_call(
        functools.partial(_gmm_kernel, transpose_rhs=transpose_rhs, quantization=quantization),
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid_spec=grid_spec,
        compiler_params=tpu_tiling.compiler_params("parallel", "arbitrary", "arbitrary"),
        cost_estimate=cost,
        interpret=interpret,
        name=f"moe_gmm_{quantization}" if quantization else "moe_gmm",
    )(*schedule, *operands)


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


def gmm_quantized(
    lhs,
    weight,
    scale,
    group_sizes,
    *,
    quantization: str,
    transpose_rhs: bool,
    out_dtype,
    tiling: Tiling | None,
    interpret: bool,
):
    """``gmm`` of a quantized [E, out, in] ``weight`` (``weight_formats``), dequantized block by
    block in VMEM: ``lhs @ W[g]^T`` with ``transpose_rhs`` (the forward), ``lhs @ W[g]``
    without (the activations' gradient). ``scale`` in the format's raw layout."""
    m, k = lhs.shape
    n = weight.shape[1] if transpose_rhs else weight.shape[2]
    tiling = tiling or default_tiling(
        "gmm", m, k, n, weight.shape[0], lhs.dtype, out_dtype, interpret=interpret
    )
    if quantization == "int8":
        scale = scale.astype(jnp.float32)[:, None, :]
    return _gmm_call(
        lhs,
        weight,
        group_sizes,
        transpose_rhs=transpose_rhs,
        out_dtype=out_dtype,
        tiling=tiling,
        interpret=interpret,
        scale=scale,
        quantization=quantization,
    )
