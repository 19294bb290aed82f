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
    """Qwen3-Next-like heads (16 q/k, 32 v, dims 128) with heads over model and batch over data:
    no collectives, forward or backward."""
    import jax
    import jax.numpy as jnp

    from . import api

    qk = jax.ShapeDtypeStruct((2, 512, 16, 128), jnp.bfloat16)
    v = jax.ShapeDtypeStruct((2, 512, 32, 128), jnp.bfloat16)
    gate = jax.ShapeDtypeStruct((2, 512, 32), jnp.float32)
    token = ("data", None, "model", None)
    return [
        MeshCase(
            "chunked GVA 16/32 batch x heads bf16",
            lambda q, k, v, g, b: api.chunk_gated_delta_rule(q, k, v, g, b, use_qk_l2norm=True)[0],
            (qk, qk, v, gate, gate),
            (token, token, token, ("data", None, "model"), ("data", None, "model")),
            ("data", "model"),
            differentiable=(0, 1, 2, 3, 4),
        )
    ]
