"""Pallas gated RMSNorm for TPU: row blocks with the whole hidden dimension in VMEM, x and the gate
read once, the result written once. The backward is a Pallas kernel on the same row blocks: each
block reads x, the gate and dy once and takes ``jax.vjp`` of the reference on its rows (the
norm is per row, so that is the block's exact share, rounding points included), writing dx, the
gate's gradient and the block's f32 sum of the weight's gradient, which XLA adds over blocks."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernel_hub.kernel_api import tiling

from .pallas_tpu import BlockConfig
from .reference import gated_rms_norm as reference

MAX_BLOCK_ROWS = 512


def default_config(rows: int, hidden: int, dtype, *, interpret: bool = False) -> BlockConfig:
    """Largest row block within the VMEM budget of the larger pass, the backward: x, gate, dy,
    dx and the gate's gradient streamed, 8 f32 temporaries."""
    if interpret:
        return BlockConfig(block_rows=rows)
    per_row = tiling.vmem_bytes_per_row(
        hidden, jnp.dtype(dtype).itemsize, streamed=5, f32_temporaries=8
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


def _backward_kernel(*refs, eps: float, norm_before_gate: bool, has_gate: bool, rows: int):
    x_ref, *refs = refs
    gate_ref = refs.pop(0) if has_gate else None
    w_ref, dy_ref, dx_ref, *refs = refs
    dgate_ref = refs.pop(0) if has_gate else None
    (dw_ref,) = refs
    block = x_ref.shape[0]
    # rows past the end (a ragged last block) hold undefined values: zeros give zero gradients
    valid = pl.program_id(0) * block + jax.lax.broadcasted_iota(jnp.int32, (block, 1), 0) < rows

    def read(ref):
        return jnp.where(valid, ref[...], jnp.zeros((), ref.dtype))

    x, dy = read(x_ref), read(dy_ref)
    gate = None if gate_ref is None else read(gate_ref)
    weight = jnp.broadcast_to(w_ref[...], x.shape)  # per-row weight gradients, summed here in f32

    def norm(x, gate, weight):
        return reference(x, gate, weight, eps, norm_before_gate, None)

    _, vjp = jax.vjp(norm, x, gate, weight)
    dx, dgate, dweight = vjp(dy)
    dx_ref[...] = dx.astype(dx_ref.dtype)
    if dgate_ref is not None:
        dgate_ref[...] = dgate.astype(dgate_ref.dtype)
    dw_ref[...] = jnp.sum(dweight.astype(jnp.float32), axis=0, keepdims=True)


def _backward(x, gate, weight, grad, eps, norm_before_gate, config: BlockConfig, interpret):
    rows, hidden = x.shape
    block = config.block_rows
    blocks = pl.cdiv(rows, block)
    row_spec = pl.BlockSpec((block, hidden), lambda i: (i, 0))
    has_gate = gate is not None
    inputs = [x] + ([gate] if has_gate else []) + [weight.reshape(1, hidden), grad]
    in_specs = [row_spec] * (2 if has_gate else 1) + [
        pl.BlockSpec((1, hidden), lambda i: (0, 0)),
        row_spec,
    ]
    out_shape = [jax.ShapeDtypeStruct(x.shape, x.dtype)]
    out_specs = [row_spec]
    if has_gate:
        out_shape.append(jax.ShapeDtypeStruct(gate.shape, gate.dtype))
        out_specs.append(row_spec)
    out_shape.append(jax.ShapeDtypeStruct((blocks, 1, hidden), jnp.float32))
    out_specs.append(pl.BlockSpec((None, 1, hidden), lambda i: (i, 0, 0)))
    cost = pl.CostEstimate(
        # the norm recomputed (10 per element, as the forward) and its vjp (~12 per element)
        flops=22 * rows * hidden,
        transcendentals=(rows * hidden if has_gate else 0) + rows,
        bytes_accessed=sum(a.size * a.dtype.itemsize for a in inputs)
        + sum(math.prod(s.shape) * s.dtype.itemsize for s in out_shape),
    )
    dx, *rest = pl.pallas_call(
        functools.partial(
            _backward_kernel,
            eps=eps,
            norm_before_gate=norm_before_gate,
            has_gate=has_gate,
            rows=rows,
        ),
        out_shape=out_shape,
        grid=(blocks,),
        in_specs=in_specs,
        out_specs=out_specs,
        compiler_params=tiling.compiler_params("parallel"),
        cost_estimate=cost,
        interpret=interpret,
        name="gated_rms_norm_backward",
    )(*inputs)
    dgate = rest.pop(0) if has_gate else None
    return dx, dgate, jnp.sum(rest[0], axis=(0, 1)).astype(weight.dtype)


def _bwd(eps, norm_before_gate, config, interpret, residuals, grad):
    x, gate, weight = residuals
    return _backward(x, gate, weight, grad, eps, norm_before_gate, config, interpret)


gated_rms_norm_2d.defvjp(_fwd, _bwd)
