"""Sharding rules of the causal convolution: batch and channels split freely (the convolution is
depthwise); the sequence and the kernel width stay whole."""

from kernel_hub.kernel_api import ShardingRule, sharded

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
