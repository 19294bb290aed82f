"""Sharding rules of the attention functions: batch and heads split (query and kv heads together,
so each shard keeps whole GQA groups); sequences and head_dim stay whole. A split sequence is
context parallelism: ``ring.ring_attention`` over a ``cp`` axis."""

from kernel_hub.kernel_api import ShardingRule, sharded

_INPUTS = (
    "batch heads q_len head_dim, batch kv_heads kv_len head_dim, batch kv_heads kv_len value_dim, "
    "batch kv_len, batch q_len, batch kv_len, heads, "  # ..., sinks
    "batch q_len, batch kv_len, batch q_len, batch kv_len"  # positions, groups
)
_OUT = "batch heads q_len value_dim"
_LSE = "batch heads q_len"
_K = "batch kv_heads kv_len head_dim"
_V = "batch kv_heads kv_len value_dim"
_DQ = "batch heads q_len head_dim"
_RING = "context parallelism: flash_attention.ring.ring_attention over a 'cp' mesh axis"
_OPTIONS = {
    "whole": ("q_len", "kv_len", "head_dim", "value_dim"),
    "together": (("heads", "kv_heads"),),
    "handled_by": {"q_len": _RING, "kv_len": _RING},
}

ATTENTION = ShardingRule.parse("dot_product_attention", f"{_INPUTS} -> {_OUT}", **_OPTIONS)
ATTENTION_WITH_LSE = ShardingRule.parse(
    "dot_product_attention_with_lse", f"{_INPUTS} -> {_OUT}, {_LSE}", **_OPTIONS
)
ATTENTION_BACKWARD = ShardingRule.parse(
    "attention_backward",
    # d_sinks ("heads") sums over batch and queries: with batch split, the boundary sums it
    # over the batch axes (a result lacking a split factor is summed, einsum-style).
    f"{_INPUTS}, {_OUT}, {_LSE}, {_OUT}, {_LSE} -> {_DQ}, {_K}, {_V}, heads",
    **_OPTIONS,
)

# Dense-mask attention: the mask and the additive bias are [B|1, H|1, Sq, Sk]; a size-1 batch or
# head dimension broadcasts (each shard reads it whole) and the bias gradient there is summed over
# the shards splitting that factor.
_MASKED = "batch? heads? q_len kv_len"
_DENSE_INPUTS = (
    "batch heads q_len head_dim, batch kv_heads kv_len head_dim, "
    f"batch kv_heads kv_len value_dim, {_MASKED}, heads, {_MASKED}"  # mask, sinks, bias
)
ATTENTION_DENSE_MASK = ShardingRule.parse(
    "attention_with_dense_mask", f"{_DENSE_INPUTS} -> {_OUT}, {_LSE}", **_OPTIONS
)
ATTENTION_DENSE_MASK_BACKWARD = ShardingRule.parse(
    "attention_with_dense_mask_backward",
    f"{_DENSE_INPUTS}, {_OUT}, {_LSE}, {_OUT}, {_LSE} -> {_DQ}, {_K}, {_V}, heads, {_MASKED}",
    **_OPTIONS,
)

# Decorators of the public JAX functions in ``api`` and ``dense_mask``.
attention_boundary = sharded(ATTENTION)
with_lse_boundary = sharded(ATTENTION_WITH_LSE)
backward_boundary = sharded(ATTENTION_BACKWARD)
dense_mask_boundary = sharded(ATTENTION_DENSE_MASK)
dense_mask_backward_boundary = sharded(ATTENTION_DENSE_MASK_BACKWARD)
