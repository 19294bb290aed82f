"""Sharding rules of the gated delta rule: batch and heads split (value heads together with their
q/k heads, so each shard keeps whole groups); the sequence, head dims and packing offsets stay
whole (the state recurrence runs along the sequence)."""

from kernel_hub.kernel_api import MeshCase, ShardingRule, sharded

_QK = "batch length key_heads key_dim"
_V = "batch length heads value_dim"
_G = "batch length heads"
_STATE = "sequences heads key_dim value_dim"
_OPTIONS = {
    "whole": ("length", "key_dim", "value_dim"),
    "together": (("heads", "key_heads"), ("batch", "sequences")),
    "handled_by": {"length": "nothing yet: the recurrence needs the whole sequence per shard"},
}

CHUNK = ShardingRule.parse(
    "chunk_gated_delta_rule",
    f"{_QK}, {_QK}, {_V}, {_G}, {_G}, {_STATE}, offsets -> {_V}, {_STATE}",
    **{**_OPTIONS, "whole": (*_OPTIONS["whole"], "offsets")},
)
DECODE = ShardingRule.parse(
    "recurrent_gated_delta_rule",
    f"{_QK}, {_QK}, {_V}, {_G}, {_G}, {_STATE} -> {_V}, {_STATE}",
    **_OPTIONS,
)

chunk_boundary = sharded(CHUNK)
decode_boundary = sharded(DECODE)


def mesh_cases() -> list[MeshCase]:
    """Qwen3-Next's heads on 2-way tensor parallel (8 q/k, 16 v, dims 128) with heads over model
    and batch over data: no collectives, forward or backward; prefill and a 2-token decode step.
    (The full 16/32 heads' XLA backward takes ~45 s to compile; halved, ~9 s.)"""
    import jax
    import jax.numpy as jnp

    from . import api

    def shapes(length):
        qk = jax.ShapeDtypeStruct((2, length, 8, 128), jnp.bfloat16)
        v = jax.ShapeDtypeStruct((2, length, 16, 128), jnp.bfloat16)
        gate = jax.ShapeDtypeStruct((2, length, 16), jnp.float32)
        return (qk, qk, v, gate, gate)

    token = ("data", None, "model", None)
    specs = (token, token, token, ("data", None, "model"), ("data", None, "model"))
    state = jax.ShapeDtypeStruct((2, 16, 128, 128), jnp.float32)
    return [
        MeshCase(
            "chunked GVA 8/16 batch x heads bf16",
            lambda q, k, v, g, b: api.chunk_gated_delta_rule(q, k, v, g, b, use_qk_l2norm=True)[0],
            shapes(256),
            specs,
            ("data", "model"),
            differentiable=(0, 1, 2, 3, 4),
            xla_backward=True,
        ),
        MeshCase(
            "decode 2 tokens GVA 8/16 batch x heads, f32 state",
            lambda q, k, v, g, b, s: api.recurrent_gated_delta_rule(
                q, k, v, g, b, s, use_qk_l2norm=True
            ),
            (*shapes(2), state),
            (*specs, ("data", "model", None, None)),
            ("data", "model"),
            differentiable=(0, 1, 2, 3, 4, 5),
            xla_backward=True,
        ),
    ]
