"""Pallas RMSNorm for TPU: row blocks with the whole hidden dimension in VMEM.

The forward saves the per-row reciprocal RMS, so the backward is one pass; a forward-only program
(the primal of ``rms_norm_2d``: no gradient taken) runs a variant that writes no statistics.
dweight is reduced per row block into a partial sum (summed by XLA afterwards) so every grid step
stays independent and the grid can be split across TensorCores ("parallel").
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernel_hub.kernel_api import tiling

from .reference import output_dtype, scale_and_round, statistics_dtype


@dataclass(frozen=True)
class BlockConfig:
    """Rows per grid step. Must be a multiple of the dtype's sublane tile, or all rows."""

    block_rows: int


@dataclass(frozen=True)
class Form:
    """Which RMSNorm: the offset added to the weight and the rounding (``reference.ROUNDINGS``)."""

    weight_offset: float = 0.0
    rounding: str = "promoted"


def vmem_bytes_per_row(hidden: int, itemsize: int) -> int:
    """The backward is the larger pass: x, g and dx blocks streamed, plus ~5 f32 temporaries
    (x, g, x_hat, w*g and the dweight contribution)."""
    return tiling.vmem_bytes_per_row(hidden, itemsize, streamed=3, f32_temporaries=5)


def default_config(rows: int, hidden: int, dtype, *, interpret: bool = False) -> BlockConfig:
    """Largest row block that fits the VMEM budget; one block per call in interpret mode."""
    if interpret:
        return BlockConfig(block_rows=rows)
    per_row = vmem_bytes_per_row(hidden, jnp.dtype(dtype).itemsize)
    return BlockConfig(block_rows=tiling.row_block(rows, per_row, dtype))


def config_problem(rows: int, dtype, config: BlockConfig) -> str | None:
    """Why a block config is illegal for TPU tiling, or None."""
    return tiling.row_block_problem(rows, config.block_rows, dtype)


def _forward_kernel(x_ref, w_ref, y_ref, *rstd_ref, eps: float, form: Form):
    """``rstd_ref`` is empty in the forward-only variant."""
    x = x_ref[...].astype(statistics_dtype(x_ref.dtype))
    rstd = jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    y_ref[...] = scale_and_round(
        x * rstd, w_ref[...], x_ref.dtype, y_ref.dtype, form.weight_offset, form.rounding
    )
    for ref in rstd_ref:
        ref[...] = rstd


def _backward_kernel(
    x_ref, w_ref, rstd_ref, g_ref, dx_ref, dw_ref, *, rows: int, weight_offset: float
):
    acc = rstd_ref.dtype
    block_rows = x_ref.shape[0]
    x = x_ref[...].astype(acc)
    g = g_ref[...].astype(acc)
    rstd = rstd_ref[...]
    x_hat = x * rstd
    wg = (w_ref[...].astype(acc) + weight_offset) * g
    correction = jnp.mean(wg * x_hat, axis=-1, keepdims=True)
    dx_ref[...] = (rstd * (wg - x_hat * correction)).astype(dx_ref.dtype)
    # Rows past the end of a ragged last block hold garbage: keep them out of dweight.
    row = pl.program_id(0) * block_rows + jax.lax.broadcasted_iota(jnp.int32, (block_rows, 1), 0)
    contribution = jnp.where(row < rows, g * x_hat, 0.0)
    dw_ref[...] = jnp.sum(contribution, axis=0, keepdims=True)


def _forward(x, weight, eps, config: BlockConfig, form: Form, interpret: bool, *, with_stats: bool):
    """(y, rstd) with the statistics, else (y,)."""
    rows, hidden = x.shape
    acc = statistics_dtype(x.dtype)
    out_dtype = output_dtype(x.dtype, weight.dtype, form.rounding)
    block = config.block_rows
    itemsize = x.dtype.itemsize
    cost = pl.CostEstimate(
        flops=4 * rows * hidden,
        transcendentals=rows,
        bytes_accessed=rows * hidden * (itemsize + jnp.dtype(out_dtype).itemsize)
        + hidden * weight.dtype.itemsize
        + with_stats * rows * jnp.dtype(acc).itemsize,
    )
    return pl.pallas_call(
        functools.partial(_forward_kernel, eps=eps, form=form),
        out_shape=(
            jax.ShapeDtypeStruct((rows, hidden), out_dtype),
            *[jax.ShapeDtypeStruct((rows, 1), acc)] * with_stats,
        ),
        grid=(pl.cdiv(rows, block),),
        in_specs=[
            pl.BlockSpec((block, hidden), lambda i: (i, 0)),
            pl.BlockSpec((1, hidden), lambda i: (0, 0)),
        ],
        out_specs=(
            pl.BlockSpec((block, hidden), lambda i: (i, 0)),
            *[pl.BlockSpec((block, 1), lambda i: (i, 0))] * with_stats,
        ),
        compiler_params=tiling.compiler_params("parallel"),
        cost_estimate=cost,
        interpret=interpret,
        name="rms_norm_forward",
    )(x, weight.reshape(1, hidden))


def _backward(x, weight, rstd, grad, config: BlockConfig, form: Form, interpret: bool):
    rows, hidden = x.shape
    block = config.block_rows
    num_blocks = pl.cdiv(rows, block)
    itemsize = x.dtype.itemsize
    cost = pl.CostEstimate(
        flops=9 * rows * hidden,
        transcendentals=0,
        bytes_accessed=rows * hidden * (itemsize + grad.dtype.itemsize + itemsize)
        + hidden * weight.dtype.itemsize
        + num_blocks * hidden * 4
        + rows * 4,
    )
    dx, dw_partial = pl.pallas_call(
        functools.partial(_backward_kernel, rows=rows, weight_offset=form.weight_offset),
        out_shape=(
            jax.ShapeDtypeStruct((rows, hidden), x.dtype),
            jax.ShapeDtypeStruct((num_blocks, 1, hidden), rstd.dtype),
        ),
        grid=(num_blocks,),
        in_specs=[
            pl.BlockSpec((block, hidden), lambda i: (i, 0)),
            pl.BlockSpec((1, hidden), lambda i: (0, 0)),
            pl.BlockSpec((block, 1), lambda i: (i, 0)),
            pl.BlockSpec((block, hidden), lambda i: (i, 0)),
        ],
        out_specs=(
            pl.BlockSpec((block, hidden), lambda i: (i, 0)),
            pl.BlockSpec((None, 1, hidden), lambda i: (i, 0, 0)),
        ),
        compiler_params=tiling.compiler_params("parallel"),
        cost_estimate=cost,
        interpret=interpret,
        name="rms_norm_backward",
    )(x, weight.reshape(1, hidden), rstd, grad)
    return dx, jnp.sum(dw_partial, axis=(0, 1)).astype(weight.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def rms_norm_2d(x, weight, eps: float, config: BlockConfig, form: Form, interpret: bool):
    """RMSNorm of a [rows, hidden] array. The backward treats ``normalized`` rounding as the
    identity (as autograd treats a cast). Without a gradient no statistics are written."""
    (y,) = _forward(x, weight, eps, config, form, interpret, with_stats=False)
    return y


def _rms_norm_fwd(x, weight, eps, config, form, interpret):
    y, rstd = _forward(x, weight, eps, config, form, interpret, with_stats=True)
    return y, (x, weight, rstd)


def _rms_norm_bwd(eps, config, form, interpret, residuals, grad):
    x, weight, rstd = residuals
    return _backward(x, weight, rstd, grad, config, form, interpret)


rms_norm_2d.defvjp(_rms_norm_fwd, _rms_norm_bwd)
