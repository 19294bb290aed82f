"""Plain jax.numpy rotary embedding: the numerics oracle, the XLA implementation, and the rounding
rules the Pallas kernel shares.

``y = x * cos + rotate(x) * sin`` on the first ``r = cos.shape[-1]`` features of ``x`` (the rest
pass through: partial rotary), where ``rotate`` is

* rotate-half (Llama): ``[-x[r/2:r], x[:r/2]]``;
* interleaved pairs (Cohere): ``(x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...)``.

Rounding follows torch's eager arithmetic, so a swapped model gives the stock model's bits:
each product and the sum are rounded to the ``arithmetic`` dtype (``promote(x, cos)``, or f32
for the forms that upcast first), and the result is cast to ``result`` (the arithmetic dtype, or
x's own for the forms that cast back).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def arithmetic_dtype(x_dtype, cos_dtype, upcast: bool) -> jnp.dtype:
    """The dtype each product and the sum round to."""
    dtype = jnp.promote_types(x_dtype, cos_dtype)
    return jnp.promote_types(dtype, jnp.float32) if upcast else dtype


def result_dtype(x_dtype, cos_dtype, upcast: bool, cast_back: bool) -> jnp.dtype:
    return jnp.dtype(x_dtype) if cast_back else arithmetic_dtype(x_dtype, cos_dtype, upcast)


def compute_dtype(dtype) -> jnp.dtype:
    """Exact container for the rounding steps: f32 (f64 for f64)."""
    return jnp.promote_types(dtype, jnp.float32)


def rotate(x: jax.Array, interleaved: bool) -> jax.Array:
    """``rotate`` of the module docstring over x's whole last axis."""
    if interleaved:
        pairs = x.reshape(*x.shape[:-1], -1, 2)
        return jnp.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(x.shape)
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def rotate_transposed(x: jax.Array, interleaved: bool) -> jax.Array:
    """The transpose of ``rotate`` (a signed permutation): ``-rotate``."""
    return -rotate(x, interleaved)


def _broadcast(cos: jax.Array, heads_axis: int) -> jax.Array:
    """[B, S, r] -> broadcastable against x ([B, H, S, D] or [B, S, H, D])."""
    return jnp.expand_dims(cos, heads_axis)


def apply(x, cos, sin, *, interleaved, heads_axis, upcast, cast_back):
    """The rotary of one tensor ``x`` (q or k), rounded as the module docstring says."""
    rot = cos.shape[-1]
    arith = arithmetic_dtype(x.dtype, cos.dtype, upcast)
    acc = compute_dtype(arith)

    def rnd(v):
        return v.astype(arith).astype(acc)

    part = x[..., :rot].astype(acc)
    c = _broadcast(cos, heads_axis).astype(acc)
    s = _broadcast(sin, heads_axis).astype(acc)
    y = rnd(rnd(part * c) + rnd(rotate(part, interleaved) * s))
    out = result_dtype(x.dtype, cos.dtype, upcast, cast_back)
    return jnp.concatenate([y.astype(out), x[..., rot:].astype(out)], axis=-1)


def apply_backward(dy, x, cos, sin, *, interleaved, heads_axis):
    """(dx, dcos, dsin) of ``apply`` for cotangent ``dy`` (math in f32/f64, one rounding)."""
    rot = cos.shape[-1]
    acc = compute_dtype(jnp.promote_types(x.dtype, cos.dtype))
    g = dy.astype(acc)
    part = x[..., :rot].astype(acc)
    c = _broadcast(cos, heads_axis).astype(acc)
    s = _broadcast(sin, heads_axis).astype(acc)
    gr = g[..., :rot]
    dx_rot = gr * c + rotate_transposed(gr * s, interleaved)
    dx = jnp.concatenate([dx_rot, g[..., rot:]], axis=-1).astype(x.dtype)

    def reduce(v):  # sum over heads, and over batch when cos is shared by the batch
        v = jnp.sum(v, axis=heads_axis)
        return jnp.sum(v, axis=0, keepdims=True) if cos.shape[0] == 1 else v

    dcos = reduce(gr * part).astype(cos.dtype)
    dsin = reduce(gr * rotate(part, interleaved)).astype(sin.dtype)
    return dx, dcos, dsin
