"""The gated activations of MoE experts, on f32 gate and up columns (kernel and reference share
them, so both compute the same formula).

``silu`` / ``gelu`` / ``gelu_tanh``: ``act(gate) * up`` (Mixtral, Qwen3-MoE, DeepSeek-V3 use silu).
``gpt_oss``: GPT-OSS's clamped form, ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``
with ``g = min(gate, limit)`` (the gate is clamped from above only).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

KINDS = ("silu", "gelu", "gelu_tanh", "gpt_oss")


@dataclass(frozen=True)
class Activation:
    """A gated activation; ``alpha`` and ``limit`` are read only by ``gpt_oss``."""

    kind: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"activation must be one of {', '.join(KINDS)}, got {self.kind!r}")

    def __call__(self, gate: jax.Array, up: jax.Array) -> jax.Array:
        if self.kind == "silu":
            return jax.nn.silu(gate) * up
        if self.kind == "gelu":
            return jax.nn.gelu(gate, approximate=False) * up
        if self.kind == "gelu_tanh":
            return jax.nn.gelu(gate, approximate=True) * up
        gate = jnp.minimum(gate, self.limit)
        up = jnp.clip(up, -self.limit, self.limit)
        return (up + 1) * (gate * jax.nn.sigmoid(gate * self.alpha))


def activation(value: Activation | str) -> Activation:
    """An ``Activation`` from itself or its kind name."""
    return value if isinstance(value, Activation) else Activation(value)
