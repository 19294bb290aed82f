"""Sharding rules of the causal convolution: batch and channels split freely (the convolution is
depthwise); the sequence and the kernel width stay whole."""

from kernel_hub.kernel_api import MeshCase, ShardingRule, sharded

_OPTIONS = {
    "whole": ("length", "width", "history", "offsets"),
    "handled_by": {"length": "nothing yet: a split sequence needs the previous shard's tail"},
}
CONV = ShardingRule.parse(
    "causal_conv1d",
    "batch length channels, channels width, channels, batch history channels, offsets"
    " -> batch length channels",
    **_OPTIONS,
)
UPDATE = ShardingRule.parse(
    "causal_conv1d_update",
    "batch length channels, batch history channels, channels width, channels"
    " -> batch length channels, batch history channels",
    whole=("length", "width", "history"),
)

conv_boundary = sharded(CONV)
update_boundary = sharded(UPDATE)


def mesh_cases() -> list[MeshCase]:
    """Qwen3-Next's conv (8192 channels, width 4) with batch over data and channels over model:
    the weight gradient is summed over the data shards; and its decode step (forward only: the
    Pallas update aliases the state, and Pallas has no JVP for aliased calls)."""
    import jax
    import jax.numpy as jnp

    from . import api

    weight = jax.ShapeDtypeStruct((8192, 4), jnp.bfloat16)
    channels = ("data", None, "model")
    return [
        MeshCase(
            "silu batch x channels bf16",
            lambda x, w: api.causal_conv1d(x, w, activation="silu"),
            (jax.ShapeDtypeStruct((4, 1024, 8192), jnp.bfloat16), weight),
            (channels, ("model", None)),
            ("data", "model"),
            differentiable=(0, 1),
            backward_collectives={"all-reduce": 1},
            xla_backward=True,
        ),
        MeshCase(
            "decode update 1 token, silu batch x channels bf16",
            lambda x, state, w: api.causal_conv1d_update(x, state, w, activation="silu"),
            (
                jax.ShapeDtypeStruct((4, 1, 8192), jnp.bfloat16),
                jax.ShapeDtypeStruct((4, 4, 8192), jnp.bfloat16),
                weight,
            ),
            (channels, channels, ("model", None)),
            ("data", "model"),
        ),
    ]
