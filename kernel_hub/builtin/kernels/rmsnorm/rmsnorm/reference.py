"""Plain jax.numpy RMSNorm: the numerics oracle and the XLA implementation."""

import jax
import jax.numpy as jnp


def statistics_dtype(dtype) -> jnp.dtype:
    """Statistics run in f32, or f64 for f64 inputs."""
    return jnp.promote_types(dtype, jnp.float32)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """``x * rsqrt(mean(x**2, -1) + eps) * weight``, statistics in f32, one rounding at the end."""
    acc = statistics_dtype(x.dtype)
    xf = x.astype(acc)
    rstd = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * rstd * weight.astype(acc)).astype(jnp.result_type(x, weight))
