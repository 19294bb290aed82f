"""Plain jax.numpy RMSNorm: the numerics oracle and the XLA implementation."""

import jax
import jax.numpy as jnp

ROUNDINGS = ("promoted", "input", "normalized")
"""Where the result is rounded, as the model families compute it (``x̂`` = normalised x in f32):

* ``promoted``: ``x̂ * w`` in f32, rounded once to the promoted dtype of x and weight;
* ``input``: ``x̂ * w`` in f32, rounded once to x's dtype (GPT-OSS, OLMo2, Gemma);
* ``normalized``: ``x̂`` rounded to x's dtype first, then ``* w`` in the promoted dtype (Llama's
  ``weight * x̂.to(x.dtype)``).
"""


def statistics_dtype(dtype) -> jnp.dtype:
    """Statistics run in f32, or f64 for f64 inputs."""
    return jnp.promote_types(dtype, jnp.float32)


def output_dtype(x_dtype, weight_dtype, rounding: str) -> jnp.dtype:
    """The result dtype for a rounding (see ``ROUNDINGS``)."""
    return jnp.dtype(x_dtype) if rounding == "input" else jnp.promote_types(x_dtype, weight_dtype)


def scale_and_round(x_hat, weight, x_dtype, out_dtype, weight_offset: float, rounding: str):
    """``x̂ * (weight + weight_offset)`` with the rounding points of ``rounding``; x̂ in the
    statistics dtype. Shared by the reference and the Pallas kernel body."""
    acc = x_hat.dtype
    if rounding == "normalized":
        x_hat = x_hat.astype(x_dtype).astype(acc)
    scale = weight.astype(acc)
    if weight_offset:
        scale = scale + weight_offset
    return (x_hat * scale).astype(out_dtype)


def rms_norm(
    x: jax.Array,
    weight: jax.Array,
    eps: float,
    weight_offset: float = 0.0,
    rounding: str = "promoted",
) -> jax.Array:
    """``x * rsqrt(mean(x**2, -1) + eps) * (weight + weight_offset)``, statistics in f32."""
    acc = statistics_dtype(x.dtype)
    xf = x.astype(acc)
    x_hat = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    out_dtype = output_dtype(x.dtype, weight.dtype, rounding)
    return scale_and_round(x_hat, weight, x.dtype, out_dtype, weight_offset, rounding)


def _silu(x):
    return x * jax.nn.sigmoid(x)


def gated_rms_norm(x, gate, weight, eps: float, norm_before_gate: bool, group_size: int | None):
    """Gated RMSNorm in the two forms of ``gated``'s docstring; the XLA implementation and the
    backward of the Pallas kernel."""
    acc = statistics_dtype(x.dtype)
    hidden = x.shape[-1]
    group = hidden if group_size is None else group_size
    h = x.astype(acc)
    if gate is not None and not norm_before_gate:
        h = h * _silu(gate.astype(acc))
    grouped = h if group == hidden else h.reshape(*h.shape[:-1], hidden // group, group)
    grouped = grouped * jax.lax.rsqrt(jnp.mean(grouped * grouped, axis=-1, keepdims=True) + eps)
    normalized = grouped.reshape(h.shape).astype(x.dtype)
    promoted = jnp.promote_types(x.dtype, weight.dtype)
    y = weight.astype(promoted) * normalized.astype(promoted)
    if gate is None or not norm_before_gate:
        return y
    return (y.astype(acc) * _silu(gate.astype(acc))).astype(x.dtype)
