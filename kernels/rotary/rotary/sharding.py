"""Sharding rule of rotary_embedding: batch, heads and sequence positions split freely (q's and
k's heads together, so grouped-query shards keep whole groups); the head dim and the rotary dim
stay whole (a rotation pairs features across them). cos and sin may be shared by the batch (size
1); their gradient is then summed over the batch shards."""

from kernel_hub.kernel_api import ShardingRule, sharded

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
