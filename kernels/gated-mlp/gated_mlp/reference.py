"""Plain jax.numpy gated activations: the numerics oracle, the XLA implementation, and the
element formulas the Pallas kernel body shares (value and derivative of each activation)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

ACTIVATIONS = ("silu", "gelu", "gelu_tanh")
"""``silu``: x * sigmoid(x) (SwiGLU); ``gelu``: the exact erf form; ``gelu_tanh``: the tanh
approximation (Gemma's ``gelu_pytorch_tanh``) (GeGLU)."""

_TANH_C = math.sqrt(2.0 / math.pi)
_TANH_K = 0.044715


def compute_dtype(dtype) -> jnp.dtype:
    """Elementwise math in f32 (f64 for f64 inputs)."""
    return jnp.promote_types(dtype, jnp.float32)


def activation(g: jax.Array, name: str) -> jax.Array:
    if name == "silu":
        return g * jax.nn.sigmoid(g)
    if name == "gelu":
        return 0.5 * g * (1.0 + jax.lax.erf(g * (1.0 / math.sqrt(2.0))))
    return 0.5 * g * (1.0 + jnp.tanh(_TANH_C * (g + _TANH_K * g * g * g)))


def activation_and_derivative(g: jax.Array, name: str) -> tuple[jax.Array, jax.Array]:
    """(act(g), act'(g)), written out so the backward recomputes rather than stores."""
    if name == "silu":
        s = jax.nn.sigmoid(g)
        return g * s, s * (1.0 + g * (1.0 - s))
    if name == "gelu":
        cdf = 0.5 * (1.0 + jax.lax.erf(g * (1.0 / math.sqrt(2.0))))
        pdf = jnp.exp(-0.5 * g * g) * (1.0 / math.sqrt(2.0 * math.pi))
        return g * cdf, cdf + g * pdf
    t = jnp.tanh(_TANH_C * (g + _TANH_K * g * g * g))
    dt = (1.0 - t * t) * _TANH_C * (1.0 + 3.0 * _TANH_K * g * g)
    return 0.5 * g * (1.0 + t), 0.5 * (1.0 + t) + 0.5 * g * dt


def gated_activation(gate: jax.Array, up: jax.Array, name: str) -> jax.Array:
    """``act(gate) * up`` computed in f32 (f64), rounded once to the inputs' dtype."""
    acc = compute_dtype(gate.dtype)
    return (activation(gate.astype(acc), name) * up.astype(acc)).astype(gate.dtype)
