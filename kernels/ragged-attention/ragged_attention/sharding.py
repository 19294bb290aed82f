"""Sharding rules of the serving attention functions: query heads split with their kv heads (each
shard keeps whole GQA groups and its slice of the sinks); packed tokens, keys and their offsets
stay whole (a sequence's rows must sit with its offsets), and so do pages (the block table holds
global page ids). Paged decode may also split its sequences: each shard reads its sequences'
pages from the whole cache. An 8-bit cache's scales ([Hkv, N] ragged, [P, Hkv, page] paged)
follow their heads."""

from kernel_hub.kernel_api import ShardingRule, sharded

_DIMS = ("head_dim", "value_dim")
RAGGED = ShardingRule.parse(
    "ragged_attention",
    "tokens heads head_dim, keys kv_heads head_dim, keys kv_heads value_dim, offsets, offsets, "
    "heads, kv_heads keys, kv_heads keys -> tokens heads value_dim",
    whole=("tokens", "keys", "offsets", *_DIMS),
    together=(("heads", "kv_heads"),),
    handled_by={
        "tokens": "data parallelism over whole sequences (one ragged batch per shard)",
        "keys": "data parallelism over whole sequences (one ragged batch per shard)",
    },
)
PAGED = ShardingRule.parse(
    "paged_attention",
    "seqs heads head_dim, pages page kv_heads head_dim, pages page kv_heads value_dim, "
    "seqs max_pages, seqs, heads, pages kv_heads page, pages kv_heads page -> seqs heads value_dim",
    whole=("pages", "page", "max_pages", *_DIMS),
    together=(("heads", "kv_heads"),),
    handled_by={"pages": "a cache per shard with shard-local page ids (not implemented)"},
)

# Decorators of the public JAX functions in ``api``.
ragged_boundary = sharded(RAGGED)
paged_boundary = sharded(PAGED)
