"""Pallas gated RMSNorm for TPU: row blocks with the whole hidden dimension in VMEM, x and the gate
read once, the result written once. The backward is ``jax.vjp`` of the XLA reference
(``reference.gated_rms_norm``); a Pallas backward is not written yet."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernel_hub.kernel_api import tiling

from .pallas_tpu import BlockConfig
from .reference import gated_rms_norm as reference

MAX_BLOCK_ROWS = 512


def default_config(rows: int, hidden: int, dtype, *, interpret: bool = False) -> BlockConfig:
    """Largest row block within the VMEM budget: x, gate and y streamed, 4 f32 temporaries."""
    if interpret:
        return BlockConfig(block_rows=rows)
    per_row = tiling.vmem_bytes_per_row(
        hidden, jnp.dtype(dtype).itemsize, streamed=3, f32_temporaries=4
    )
    return BlockConfig(block_rows=tiling.row_block(rows, per_row, dtype, max_rows=MAX_BLOCK_ROWS))


def _kernel(*refs, eps: float, norm_before_gate: bool, has_gate: bool):
    if has_gate:
        x_ref, gate_ref, w_ref, y_ref = refs
        gate = gate_ref[...]
    else:
        (x_ref, w_ref, y_ref), gate = refs, None
    y_ref[...] = reference(x_ref[...], gate, w_ref[...], eps, norm_before_gate, None).astype(
        y_ref.dtype
    )


def _forward(x, gate, weight, eps, norm_before_gate, config: BlockConfig, interpret):
    rows, hidden = x.shape
    block = config.block_rows
    out = jax.eval_shape(
        lambda a, g, w: reference(a, g, w, eps, norm_before_gate, None), x, gate, weight
    )
    row_spec = pl.BlockSpec((block, hidden), lambda i: (i, 0))
    inputs = [x] + ([gate] if gate is not None else []) + [weight.reshape(1, hidden)]
    specs = [row_spec] * (2 if gate is not None else 1) + [
        pl.BlockSpec((1, hidden), lambda i: (0, 0))
    ]
    itemsize = x.dtype.itemsize
    cost = pl.CostEstimate(
        flops=10 * rows * hidden,
        transcendentals=rows * hidden + rows,
        bytes_accessed=rows * hidden * (len(inputs) - 1) * itemsize
        + rows * hidden * out.dtype.itemsize
        + hidden * weight.dtype.itemsize,
    )
    return pl.pallas_call(
        functools.partial(
            _kernel, eps=eps, norm_before_gate=norm_before_gate, has_gate=gate is not None
        ),
        out_shape=jax.ShapeDtypeStruct((rows, hidden), out.dtype),
        grid=(pl.cdiv(rows, block),),
        in_specs=specs,
        out_specs=row_spec,
        compiler_params=tiling.compiler_params("parallel"),
        cost_estimate=cost,
        interpret=interpret,
        name="gated_rms_norm",
    )(*inputs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def gated_rms_norm_2d(x, gate, weight, eps, norm_before_gate, config, interpret):
    """Gated RMSNorm of [rows, hidden] x (and gate, or None)."""
    return _forward(x, gate, weight, eps, norm_before_gate, config, interpret)


def _fwd(x, gate, weight, eps, norm_before_gate, config, interpret):
    y = _forward(x, gate, weight, eps, norm_before_gate, config, interpret)
    return y, (x, gate, weight)


def _bwd(eps, norm_before_gate, config, interpret, residuals, grad):
    _, vjp = jax.vjp(lambda x, g, w: reference(x, g, w, eps, norm_before_gate, None), *residuals)
    return vjp(grad)


gated_rms_norm_2d.defvjp(_fwd, _bwd)
