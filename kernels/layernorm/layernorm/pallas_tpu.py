"""Pallas LayerNorm for TPU: row blocks with the whole hidden dimension in VMEM.

One pass over HBM each way. The forward saves each row's mean and reciprocal standard deviation
(f32), so the backward needs no recomputation of the statistics; a forward-only program (the
primal of ``layer_norm_2d``: no gradient taken) runs a variant that writes no statistics. dweight
and dbias are reduced per row block into partial sums (summed by XLA afterwards), so every grid
step is independent and the grid can be split across TensorCores ("parallel"). Weight and bias
are optional: a missing one is neither read nor differentiated (``elementwise_affine=False``,
``bias=False``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernel_hub.kernel_api import tiling

from .reference import statistics_dtype


@dataclass(frozen=True)
class BlockConfig:
    """Rows per grid step. Must be a multiple of the dtype's sublane tile, or all rows."""

    block_rows: int


@dataclass(frozen=True)
class Affine:
    """Which of weight and bias a call has (static: each combination is its own kernel)."""

    weight: bool
    bias: bool


def vmem_bytes_per_row(hidden: int, itemsize: int) -> int:
    """The backward is the larger pass: x, g and dx blocks streamed, plus ~6 f32 temporaries
    (x_hat, g, w*g, their product and the dweight and dbias contributions)."""
    return tiling.vmem_bytes_per_row(hidden, itemsize, streamed=3, f32_temporaries=6)


def default_config(rows: int, hidden: int, dtype, *, interpret: bool = False) -> BlockConfig:
    """Largest row block that fits the VMEM budget; one block per call in interpret mode."""
    if interpret:
        return BlockConfig(block_rows=rows)
    per_row = vmem_bytes_per_row(hidden, jnp.dtype(dtype).itemsize)
    return BlockConfig(block_rows=tiling.row_block(rows, per_row, dtype))


def config_problem(rows: int, dtype, config: BlockConfig) -> str | None:
    """Why a block config is illegal for TPU tiling, or None."""
    return tiling.row_block_problem(rows, config.block_rows, dtype)


def _split_refs(refs, affine: Affine):
    """(x, weight or None, bias or None, *rest) from a kernel's flat ref list."""
    x_ref, *rest = refs
    w_ref = rest.pop(0) if affine.weight else None
    b_ref = rest.pop(0) if affine.bias else None
    return x_ref, w_ref, b_ref, rest


def _forward_kernel(*refs, eps: float, affine: Affine):
    """The statistics outputs (mean, rstd) are absent in the forward-only variant."""
    x_ref, w_ref, b_ref, (y_ref, *stat_refs) = _split_refs(refs, affine)
    acc = statistics_dtype(x_ref.dtype)
    x = x_ref[...].astype(acc)
    mean = jnp.mean(x, axis=-1, keepdims=True)
    centered = x - mean
    rstd = jax.lax.rsqrt(jnp.mean(centered * centered, axis=-1, keepdims=True) + eps)
    y = centered * rstd
    if w_ref is not None:
        y = y * w_ref[...].astype(acc)
    if b_ref is not None:
        y = y + b_ref[...].astype(acc)
    y_ref[...] = y.astype(y_ref.dtype)
    for ref, value in zip(stat_refs, (mean, rstd), strict=False):
        ref[...] = value


def _backward_kernel(*refs, rows: int, affine: Affine):
    # The bias is not an input here: no gradient depends on its value.
    x_ref, w_ref, _, rest = _split_refs(refs, Affine(weight=affine.weight, bias=False))
    mean_ref, rstd_ref, g_ref, dx_ref, *partial_refs = rest
    acc = rstd_ref.dtype
    block_rows = x_ref.shape[0]
    rstd = rstd_ref[...]
    x_hat = (x_ref[...].astype(acc) - mean_ref[...]) * rstd
    g = g_ref[...].astype(acc)
    wg = g * w_ref[...].astype(acc) if w_ref is not None else g
    mean_wg = jnp.mean(wg, axis=-1, keepdims=True)
    mean_wg_xhat = jnp.mean(wg * x_hat, axis=-1, keepdims=True)
    dx_ref[...] = (rstd * (wg - mean_wg - x_hat * mean_wg_xhat)).astype(dx_ref.dtype)
    # Rows past the end of a ragged last block hold garbage: keep them out of the partial sums.
    row = pl.program_id(0) * block_rows + jax.lax.broadcasted_iota(jnp.int32, (block_rows, 1), 0)
    real = row < rows
    partials = iter(partial_refs)
    if affine.weight:
        next(partials)[...] = jnp.sum(jnp.where(real, g * x_hat, 0.0), axis=0, keepdims=True)
    if affine.bias:
        next(partials)[...] = jnp.sum(jnp.where(real, g, 0.0), axis=0, keepdims=True)


def _affine_inputs(weight, bias, hidden: int):
    """The present affine parameters as [1, hidden] arrays, with their block specs."""
    arrays = [p.reshape(1, hidden) for p in (weight, bias) if p is not None]
    specs = [pl.BlockSpec((1, hidden), lambda i: (0, 0)) for _ in arrays]
    return arrays, specs


def _row_stat_spec(block: int) -> pl.BlockSpec:
    return pl.BlockSpec((block, 1), lambda i: (i, 0))


def _forward(x, weight, bias, eps, config: BlockConfig, interpret: bool, *, with_stats: bool):
    """(y, mean, rstd) with the statistics, else (y,)."""
    rows, hidden = x.shape
    affine = Affine(weight is not None, bias is not None)
    acc = statistics_dtype(x.dtype)
    block = config.block_rows
    params, param_specs = _affine_inputs(weight, bias, hidden)
    cost = pl.CostEstimate(
        flops=(5 + affine.weight + affine.bias) * rows * hidden,
        transcendentals=rows,
        bytes_accessed=2 * rows * hidden * x.dtype.itemsize
        + sum(p.size * p.dtype.itemsize for p in params)
        + with_stats * 2 * rows * jnp.dtype(acc).itemsize,
    )
    return pl.pallas_call(
        functools.partial(_forward_kernel, eps=eps, affine=affine),
        out_shape=(
            jax.ShapeDtypeStruct((rows, hidden), x.dtype),
            *[jax.ShapeDtypeStruct((rows, 1), acc)] * (2 * with_stats),
        ),
        grid=(pl.cdiv(rows, block),),
        in_specs=[pl.BlockSpec((block, hidden), lambda i: (i, 0)), *param_specs],
        out_specs=(
            pl.BlockSpec((block, hidden), lambda i: (i, 0)),
            *[_row_stat_spec(block)] * (2 * with_stats),
        ),
        compiler_params=tiling.compiler_params("parallel"),
        cost_estimate=cost,
        interpret=interpret,
        name="layer_norm_forward",
    )(x, *params)


def _backward(x, weight, bias, mean, rstd, grad, config: BlockConfig, interpret: bool):
    rows, hidden = x.shape
    affine = Affine(weight is not None, bias is not None)
    block = config.block_rows
    num_blocks = pl.cdiv(rows, block)
    params, param_specs = _affine_inputs(weight, None, hidden)
    partial = jax.ShapeDtypeStruct((num_blocks, 1, hidden), rstd.dtype)
    num_partials = affine.weight + affine.bias
    cost = pl.CostEstimate(
        flops=(10 + 2 * num_partials) * rows * hidden,
        transcendentals=0,
        bytes_accessed=rows * hidden * (2 * x.dtype.itemsize + grad.dtype.itemsize)
        + sum(p.size * p.dtype.itemsize for p in params)
        + num_partials * num_blocks * hidden * 4
        + 2 * rows * 4,
    )
    dx, *partials = pl.pallas_call(
        functools.partial(_backward_kernel, rows=rows, affine=affine),
        out_shape=(jax.ShapeDtypeStruct((rows, hidden), x.dtype), *[partial] * num_partials),
        grid=(num_blocks,),
        in_specs=[
            pl.BlockSpec((block, hidden), lambda i: (i, 0)),
            *param_specs,
            _row_stat_spec(block),
            _row_stat_spec(block),
            pl.BlockSpec((block, hidden), lambda i: (i, 0)),
        ],
        out_specs=(
            pl.BlockSpec((block, hidden), lambda i: (i, 0)),
            *[pl.BlockSpec((None, 1, hidden), lambda i: (i, 0, 0))] * num_partials,
        ),
        compiler_params=tiling.compiler_params("parallel"),
        cost_estimate=cost,
        interpret=interpret,
        name="layer_norm_backward",
    )(x, *params, mean, rstd, grad)
    sums = iter(partials)
    dweight = None if weight is None else jnp.sum(next(sums), axis=(0, 1)).astype(weight.dtype)
    dbias = None if bias is None else jnp.sum(next(sums), axis=(0, 1)).astype(bias.dtype)
    return dx, dweight, dbias


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def layer_norm_2d(x, weight, bias, eps: float, config: BlockConfig, interpret: bool):
    """LayerNorm of a [rows, hidden] array; ``weight`` and ``bias`` are [hidden] or None. Without a
    gradient no statistics are written."""
    (y,) = _forward(x, weight, bias, eps, config, interpret, with_stats=False)
    return y


def _layer_norm_fwd(x, weight, bias, eps, config, interpret):
    y, mean, rstd = _forward(x, weight, bias, eps, config, interpret, with_stats=True)
    return y, (x, weight, bias, mean, rstd)


def _layer_norm_bwd(eps, config, interpret, residuals, grad):
    x, weight, bias, mean, rstd = residuals
    return _backward(x, weight, bias, mean, rstd, grad, config, interpret)


layer_norm_2d.defvjp(_layer_norm_fwd, _layer_norm_bwd)
