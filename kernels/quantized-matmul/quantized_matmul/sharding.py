"""Sharding rule of quantized_matmul: the weight's output dim (``n``, over ``model`` by the
conventions) splits freely; its contraction dim ``k`` (over ``data``) splits with partial
products summed over the shards. Scales follow their weights: int8's [n] holds the output dim;
fp8's block grid [n / 128, k / 128] holds both under the weight's factors, so a split reaches
the scale only when its block count divides too (each shard then holds whole blocks)."""

from kernel_hub.kernel_api import ShardingRule, sharded

_INT8 = ShardingRule.parse("quantized_matmul", "... k, n k, n -> ... n", reduced=("k",))
_FP8 = ShardingRule.parse("quantized_matmul", "... k, n k, n k -> ... n", reduced=("k",))


def rule(ranks: tuple = (), **options) -> ShardingRule:
    """The rule for the scale's rank (1: int8 per channel, 2: fp8 block grid)."""
    return _FP8 if len(ranks) > 2 and ranks[2] == 2 else _INT8


boundary = sharded(rule)
"""Decorator of ``api.quantized_matmul``: shard_map over the mesh its inputs are sharded on."""
