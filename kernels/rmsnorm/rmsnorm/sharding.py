"""Sharding rule of rms_norm: rows split freely, the normalised axis stays whole."""

from kernel_hub.kernel_api import ShardingRule, sharded

RMS_NORM = ShardingRule.parse(
    "rms_norm",
    "... hidden, hidden -> ... hidden",
    whole=("hidden",),
    handled_by={"hidden": "an all-gather of x before the norm (the statistics need every column)"},
)

boundary = sharded(RMS_NORM)
"""Decorator of ``api.rms_norm``: shard_map over the mesh its inputs are sharded on."""


GATED_RMS_NORM = ShardingRule.parse(
    "gated_rms_norm",
    "... hidden, ... hidden, hidden -> ... hidden",
    whole=("hidden",),
    handled_by={"hidden": "an all-gather of x and the gate before the norm"},
)

gated_boundary = sharded(GATED_RMS_NORM)
"""Decorator of ``gated.gated_rms_norm``."""
