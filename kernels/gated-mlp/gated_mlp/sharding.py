"""Sharding rule of gated_activation: rows split freely; the feature axis stays whole, since in
the fused layout (``up=None``) a split would separate gate columns from their up columns."""

from kernel_hub.kernel_api import ShardingRule, sharded

GATED_ACTIVATION = ShardingRule.parse(
    "gated_activation",
    "... i, ... i -> ... i",
    whole=("i",),
    handled_by={"i": "nothing yet: gather the intermediate features first"},
)

boundary = sharded(GATED_ACTIVATION)
"""Decorator of ``api.gated_activation``: shard_map over the mesh its inputs are sharded on."""
