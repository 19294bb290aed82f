"""Sharding rules of the gated delta rule: batch and heads split (value heads together with their
q/k heads, so each shard keeps whole groups); the sequence, head dims and packing offsets stay
whole (the state recurrence runs along the sequence)."""

from kernel_hub.kernel_api import ShardingRule, sharded

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
