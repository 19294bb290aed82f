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
    over data: no collectives in the forward; the backward (XLA's) sums A's gradient over the
    batch shards. The decode step is forward only (its Pallas kernel aliases the state, and
    Pallas has no JVP for aliased calls)."""
    import jax
    import jax.numpy as jnp

    from . import api

    def struct(shape, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype)

    x, dt, bc = struct((2, 512, 64, 64)), struct((2, 512, 64)), struct((2, 512, 8, 128))
    token = ("data", None, "model", None)
    step = ("data", "model", None)
    per_head = ("model", None)
    decode_specs = (("data", "model", None, None), step, step, ("model", None, None), step, step)
    return [
        MeshCase(
            "chunk scan 64 heads / 8 groups, batch x heads bf16",
            lambda x, dt, a, b, c: api.mamba_chunk_scan_combined(
                x, dt, a, b, c, chunk_size=128, dt_softplus=True
            )[0],
            (x, dt, struct((64,), jnp.float32), bc, bc),
            (token, ("data", None, "model"), ("model",), token, token),
            ("data", "model"),
            differentiable=(0, 1, 2, 3, 4),
            backward_collectives={"all-reduce": 1},
            xla_backward=True,
        ),
        MeshCase(
            "decode step 64 heads / 8 groups, batch x heads, f32 state",
            lambda state, x, dt, a, b, c, d, z, bias: api.selective_state_update(
                state, x, dt, a, b, c, d, z, bias, dt_softplus=True
            ),
            (
                struct((8, 64, 64, 128), jnp.float32),
                struct((8, 64, 64)),
                struct((8, 64, 64)),
                struct((64, 64, 128), jnp.float32),
                struct((8, 8, 128)),
                struct((8, 8, 128)),
                struct((64, 64), jnp.float32),
                struct((8, 64, 64)),
                struct((64, 64), jnp.float32),
            ),
            (*decode_specs, per_head, step, per_head),
            ("data", "model"),
        ),
    ]
