"""Sharding rules of the Mamba-2 scan: batch and heads split (B/C groups together with their
heads, so each shard keeps whole groups); the sequence, head dim and state dim stay whole (the
recurrence runs along the sequence)."""

from kernel_hub.kernel_api import ShardingRule, sharded

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
