"""Plain jax.numpy LayerNorm: the numerics oracle and the XLA implementation."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def statistics_dtype(dtype) -> jnp.dtype:
    """Statistics run in f32, or f64 for f64 inputs."""
    return jnp.promote_types(dtype, jnp.float32)


def layer_norm(
    x: jax.Array, weight: jax.Array | None, bias: jax.Array | None, eps: float
) -> jax.Array:
    """``(x - mean) * rsqrt(var + eps) * weight + bias`` over the last axis (biased variance, as
    torch), statistics and affine in f32, one rounding to ``x``'s dtype at the end."""
    acc = statistics_dtype(x.dtype)
    xf = x.astype(acc)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    centered = xf - mean
    rstd = jax.lax.rsqrt(jnp.mean(centered * centered, axis=-1, keepdims=True) + eps)
    y = centered * rstd
    if weight is not None:
        y = y * weight.astype(acc)
    if bias is not None:
        y = y + bias.astype(acc)
    return y.astype(x.dtype)
