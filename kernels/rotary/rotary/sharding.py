"""Sharding rule of rotary_embedding: batch, heads and sequence positions split freely (q's and
k's heads together, so grouped-query shards keep whole groups); the head dim and the rotary dim
stay whole (a rotation pairs features across them). cos and sin may be shared by the batch (size
1); their gradient is then summed over the batch shards."""

from kernel_hub.kernel_api import MeshCase, ShardingRule, sharded

_LAYOUTS = {
    1: "batch heads seq d, batch kv_heads seq d",
    2: "batch seq heads d, batch seq kv_heads d",
}
"""Factor names as the other rules name them: Auto meshes split ``batch`` and ``heads`` by them
(``sharding.context.CONVENTIONAL_AXES``)."""


def rule(unsqueeze_dim: int = 1, **_options) -> ShardingRule:
    """The rule for q and k laid out as ``unsqueeze_dim`` says (heads at axis 1 or 2)."""
    tensors = _LAYOUTS.get(unsqueeze_dim, _LAYOUTS[1])  # a bad value is refused by the checks
    return ShardingRule.parse(
        "rotary_embedding",
        f"{tensors}, batch? seq r, batch? seq r -> {tensors}",
        whole=("d", "r"),
        together=(("heads", "kv_heads"),),
        handled_by={"d": "nothing: a rotation pairs head-dim features"},
    )


boundary = sharded(rule)
"""Decorator of ``api.rotary_embedding``: shard_map over the mesh its inputs are sharded on."""


def mesh_cases() -> list[MeshCase]:
    """Batch over data and heads over model (grouped-query k), both layouts; tables shared by
    the batch, their gradient summed over the data shards. On an Auto mesh the sequence split is
    resharded to the conventions' batch split (all-to-all)."""
    import jax
    import jax.numpy as jnp

    from . import api

    table = jax.ShapeDtypeStruct((16, 512, 128), jnp.float32)
    return [
        MeshCase(
            "batch over data, heads over model bf16",
            lambda q, k, c, s: api.rotary_embedding(q, k, c, s),
            (
                jax.ShapeDtypeStruct((16, 32, 512, 128), jnp.bfloat16),
                jax.ShapeDtypeStruct((16, 8, 512, 128), jnp.bfloat16),
                table,
                table,
            ),
            (
                ("data", "model", None, None),
                ("data", "model", None, None),
                ("data", None, None),
                ("data", None, None),
            ),
            ("data", "model"),
            differentiable=(0, 1),
        ),
        MeshCase(
            "[B, S, H, D] layout, sequence over data, heads over model bf16",
            lambda q, k, c, s: api.rotary_embedding(q, k, c, s, unsqueeze_dim=2),
            (
                jax.ShapeDtypeStruct((16, 512, 32, 128), jnp.bfloat16),
                jax.ShapeDtypeStruct((16, 512, 8, 128), jnp.bfloat16),
                table,
                table,
            ),
            (
                (None, "data", "model", None),
                (None, "data", "model", None),
                (None, "data", None),
                (None, "data", None),
            ),
            ("data", "model"),
            differentiable=(0, 1),
            auto_forward_collectives={"all-to-all": 2},
            auto_backward_collectives={"all-to-all": 2},
        ),
        MeshCase(
            "shared tables, batch over data, heads over model bf16",
            lambda q, k, c, s: api.rotary_embedding(q, k, c, s),
            (
                jax.ShapeDtypeStruct((16, 32, 512, 128), jnp.bfloat16),
                jax.ShapeDtypeStruct((16, 8, 512, 128), jnp.bfloat16),
                jax.ShapeDtypeStruct((1, 512, 128), jnp.float32),
                jax.ShapeDtypeStruct((1, 512, 128), jnp.float32),
            ),
            (("data", "model", None, None), ("data", "model", None, None), (), ()),
            ("data", "model"),
            differentiable=(0, 1, 2, 3),
            backward_collectives={"all-reduce": 1},
        ),
    ]
