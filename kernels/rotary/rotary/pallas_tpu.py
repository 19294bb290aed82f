"""Pallas rotary embedding for TPU: q and k in one call, blocks of sequence positions.

Grid (batch, sequence blocks), both parallel: each step reads one [block_seq, D] block of cos and
sin once and rotates every head of q and of k at those positions, so cos and sin cross HBM once
per call, not once per head. ``rotate`` is two lane rolls and a select (no lane slicing or
concatenation): rotate-half takes ``-x[j + r/2]`` below ``r/2`` and ``x[j - r/2]`` above;
interleaved pairs take ``-x[j + 1]`` on even lanes and ``x[j - 1]`` on odd ones. Lanes at and past
``r`` (partial rotary) pass through. cos and sin arrive zero-padded to D.

The backward is the transpose: ``dx = dy * cos - rotate(dy * sin)`` on the rotated lanes, ``dy``
on the others (a rotation by -theta when cos and sin repeat per pair, as in every model).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernel_hub.kernel_api import tiling

from .reference import arithmetic_dtype, compute_dtype, result_dtype


@dataclass(frozen=True)
class Form:
    """What the kernel computes (static): see ``reference``."""

    rot: int
    """Rotated features (cos.shape[-1]); the rest of D passes through."""
    interleaved: bool
    heads_axis: int
    """1: q, k are [B, H, S, D]; 2: [B, S, H, D]."""
    upcast: bool
    cast_back: bool


@dataclass(frozen=True)
class BlockConfig:
    """Sequence positions per grid step (with heads_axis 1 a multiple of the sublane tile, or
    all of S)."""

    block_seq: int


def vmem_bytes_per_position(heads: int, width: int, itemsize: int) -> int:
    """q and k blocks in and out plus cos and sin, double-buffered, and ~4 live f32 temporaries
    per head row (x, the two rolls, the result)."""
    return tiling.vmem_bytes_per_row(
        width, itemsize, streamed=2 * heads + 2, f32_temporaries=4 * heads
    )


def default_config(seq: int, heads: int, width: int, dtype) -> BlockConfig:
    per = vmem_bytes_per_position(heads, width, jnp.dtype(dtype).itemsize)
    return BlockConfig(tiling.row_block(seq, per, dtype))


def config_problem(seq: int, dtype, config: BlockConfig, heads_axis: int) -> str | None:
    if heads_axis == 2:
        if config.block_seq > 0:
            return None
        return f"block_seq={config.block_seq} must be positive"
    problem = tiling.row_block_problem(seq, config.block_seq, dtype)
    return problem and problem.replace("block_rows", "block_seq").replace("rows", "sequence")


def _rotate(x, rot: int, interleaved: bool):
    """``rotate`` over the last axis of x (lanes), by rolls and a select; lanes >= rot: junk."""
    width = x.shape[-1]
    axis = x.ndim - 1
    step = 1 if interleaved else rot // 2
    ahead = pltpu.roll(x, width - step, axis)  # ahead[j] = x[j + step]
    behind = pltpu.roll(x, step, axis)  # behind[j] = x[j - step]
    lane = jax.lax.broadcasted_iota(jnp.int32, x.shape, axis)
    first = (lane % 2 == 0) if interleaved else (lane < step)
    return jnp.where(first, -ahead, behind)


def _cos_sin(c_ref, s_ref, form: Form, acc):
    c, s = c_ref[0].astype(acc), s_ref[0].astype(acc)  # [block_seq, D]
    if form.heads_axis == 1:
        return c[None], s[None]
    return c[:, None, :], s[:, None, :]


def _forward_kernel(q_ref, k_ref, c_ref, s_ref, qo_ref, ko_ref, *, form: Form):
    for x_ref, o_ref in ((q_ref, qo_ref), (k_ref, ko_ref)):
        arith = arithmetic_dtype(x_ref.dtype, c_ref.dtype, form.upcast)
        acc = compute_dtype(arith)
        c, s = _cos_sin(c_ref, s_ref, form, acc)

        def rnd(v, arith=arith, acc=acc):
            return v.astype(arith).astype(acc)

        x = x_ref[0].astype(acc)
        y = rnd(rnd(x * c) + rnd(_rotate(x, form.rot, form.interleaved) * s))
        lane = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
        o_ref[0] = jnp.where(lane < form.rot, y, x).astype(o_ref.dtype)


def _backward_kernel(gq_ref, gk_ref, c_ref, s_ref, dq_ref, dk_ref, *, form: Form):
    for g_ref, d_ref in ((gq_ref, dq_ref), (gk_ref, dk_ref)):
        acc = compute_dtype(jnp.promote_types(d_ref.dtype, c_ref.dtype))
        c, s = _cos_sin(c_ref, s_ref, form, acc)
        g = g_ref[0].astype(acc)
        dx = g * c - _rotate(g * s, form.rot, form.interleaved)
        lane = jax.lax.broadcasted_iota(jnp.int32, g.shape, g.ndim - 1)
        d_ref[0] = jnp.where(lane < form.rot, dx, g).astype(d_ref.dtype)


def _specs(q, k, cos, form: Form, config: BlockConfig):
    width = q.shape[-1]
    bs = config.block_seq

    def tensor_spec(x):
        heads = x.shape[form.heads_axis]
        if form.heads_axis == 1:
            return pl.BlockSpec((1, heads, bs, width), lambda b, i: (b, 0, i, 0))
        return pl.BlockSpec((1, bs, heads, width), lambda b, i: (b, i, 0, 0))

    shared = cos.shape[0] == 1
    table = pl.BlockSpec((1, bs, width), lambda b, i: (0 if shared else b, i, 0))
    return tensor_spec(q), tensor_spec(k), table


def _grid(q, form: Form, config: BlockConfig):
    seq = q.shape[3 - form.heads_axis]
    return (q.shape[0], pl.cdiv(seq, config.block_seq))


def _cost(q, k, cos, out_itemsize: int, passes: int):
    elements = q.size + k.size
    return pl.CostEstimate(
        flops=3 * elements * passes,
        transcendentals=0,
        bytes_accessed=elements * (q.dtype.itemsize + out_itemsize)
        + 2 * cos.size * cos.dtype.itemsize,
    )


def forward(q, k, cos, sin, form: Form, config: BlockConfig, interpret: bool):
    """(q_out, k_out); cos and sin [Bc, S, D] (zero-padded past ``form.rot``), Bc 1 or B."""
    q_spec, k_spec, table = _specs(q, k, cos, form, config)
    out = result_dtype(q.dtype, cos.dtype, form.upcast, form.cast_back)
    out_k = result_dtype(k.dtype, cos.dtype, form.upcast, form.cast_back)
    return pl.pallas_call(
        functools.partial(_forward_kernel, form=form),
        grid=_grid(q, form, config),
        in_specs=[q_spec, k_spec, table, table],
        out_specs=[q_spec, k_spec],
        out_shape=[jax.ShapeDtypeStruct(q.shape, out), jax.ShapeDtypeStruct(k.shape, out_k)],
        compiler_params=tiling.compiler_params("parallel", "parallel"),
        cost_estimate=_cost(q, k, cos, jnp.dtype(out).itemsize, 1),
        interpret=interpret,
        name="rotary_forward",
    )(q, k, cos, sin)


def backward(gq, gk, cos, sin, q_dtype, k_dtype, form: Form, config, interpret: bool):
    """(dq, dk) in q's and k's dtypes from the cotangents of ``forward``'s outputs."""
    q_spec, k_spec, table = _specs(gq, gk, cos, form, config)
    return pl.pallas_call(
        functools.partial(_backward_kernel, form=form),
        grid=_grid(gq, form, config),
        in_specs=[q_spec, k_spec, table, table],
        out_specs=[q_spec, k_spec],
        out_shape=[
            jax.ShapeDtypeStruct(gq.shape, q_dtype),
            jax.ShapeDtypeStruct(gk.shape, k_dtype),
        ],
        compiler_params=tiling.compiler_params("parallel", "parallel"),
        cost_estimate=_cost(gq, gk, cos, jnp.dtype(q_dtype).itemsize, 1),
        interpret=interpret,
        name="rotary_backward",
    )(gq, gk, cos, sin)
