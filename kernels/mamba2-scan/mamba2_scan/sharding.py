"""Sharding rules of the Mamba-2 scan: batch and heads split (B/C groups together with their
heads, so each shard keeps whole groups); the sequence, head dim and state dim stay whole (the
recurrence runs along the sequence)."""

from kernel_hub.kernel_api import MeshCase, ShardingRule, sharded

_X = "batch length heads head_dim"
_BC = "batch length groups state"
_STATE = "batch heads head_dim state"
_OPTIONS = {
    "whole": ("length", "head_dim", "state"),
    "together": (("heads", "groups"),),
    "handled_by": {"length": "nothing yet: the recurrence needs the whole sequence per shard"},
}

CHUNK = ShardingRule.parse(
    "mamba_chunk_scan_combined",
    f"{_X}, batch length heads, heads, {_BC}, {_BC}, heads, heads, {_STATE}, "
    f"batch length -> {_X}, {_STATE}",
    **_OPTIONS,
)
_TOKEN = "batch heads head_dim"
_GROUP = "batch groups state"
DECODE = ShardingRule.parse(
    "selective_state_update",
    f"{_STATE}, {_TOKEN}, {_TOKEN}, heads head_dim state, {_GROUP}, {_GROUP}, heads head_dim, "
    f"{_TOKEN}, heads head_dim -> {_TOKEN}, {_STATE}",
    **{**_OPTIONS, "whole": ("head_dim", "state")},
)

chunk_boundary = sharded(CHUNK)
decode_boundary = sharded(DECODE)


def mesh_cases() -> list[MeshCase]:
    """Nemotron-H-like heads (64 heads of 64, 8 groups, state 128) with heads over model and batch
    over data: no collectives in the forward."""
    import jax
    import jax.numpy as jnp

    from . import api

    x = jax.ShapeDtypeStruct((2, 512, 64, 64), jnp.bfloat16)
    dt = jax.ShapeDtypeStruct((2, 512, 64), jnp.bfloat16)
    a = jax.ShapeDtypeStruct((64,), jnp.float32)
    bc = jax.ShapeDtypeStruct((2, 512, 8, 128), jnp.bfloat16)
    token = ("data", None, "model", None)
    return [
        MeshCase(
            "chunk scan 64 heads / 8 groups, batch x heads bf16",
            lambda x, dt, a, b, c: api.mamba_chunk_scan_combined(
                x, dt, a, b, c, chunk_size=128, dt_softplus=True
            )[0],
            (x, dt, a, bc, bc),
            (token, ("data", None, "model"), ("model",), token, token),
            ("data", "model"),
            # the backward is XLA's (no Mosaic kernel for compile-check --mesh to find); it
            # compiles on this mesh with one all-reduce: A's gradient summed over the batch shards
            differentiable=(),
        )
    ]
