"""Sharding rules of the attention functions: batch and heads split (query and kv heads together,
so each shard keeps whole GQA groups); sequences and head_dim stay whole. A split sequence is
context parallelism: ``ring.ring_attention`` over a ``cp`` axis."""

from kernel_hub.kernel_api import MeshCase, ShardingRule, sharded

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


def mesh_cases() -> list[MeshCase]:
    """Causal GQA 32/8 with batch over data and heads over model (no collectives needed), and
    causal rings over cp, contiguous, zig-zag and with a sliding window (K/V passed on with
    collective-permute)."""
    import jax
    import jax.numpy as jnp

    from . import api, ring

    long_q = jax.ShapeDtypeStruct((1, 32, 4096, 128), jnp.bfloat16)
    long_kv = jax.ShapeDtypeStruct((1, 8, 4096, 128), jnp.bfloat16)
    cp = (None, None, "cp", None)
    q = jax.ShapeDtypeStruct((2, 32, 1024, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 8, 1024, 128), jnp.bfloat16)
    spec = ("data", "model", None, None)
    return [
        MeshCase(
            "causal GQA 32/8 batch x heads bf16",
            lambda q, k, v: api.dot_product_attention(q, k, v, causal=True),
            (q, kv, kv),
            (spec, spec, spec),
            ("data", "model"),
            differentiable=(0, 1, 2),
        ),
        MeshCase(
            "ring attention causal GQA 32/8 S4096 over cp bf16",
            lambda q, k, v: ring.ring_attention(q, k, v, causal=True),
            (long_q, long_kv, long_kv),
            (cp, cp, cp),
            ("cp",),
            differentiable=(0, 1, 2),
            forward_collectives={"collective-permute": 3},
            backward_collectives={"collective-permute": 3},
            control=False,
        ),
        MeshCase(
            "zig-zag ring attention causal GQA 32/8 S4096 over cp bf16",
            lambda q, k, v: ring.ring_attention(q, k, v, causal=True, layout="zigzag"),
            (long_q, long_kv, long_kv),
            (cp, cp, cp),
            ("cp",),
            differentiable=(0, 1, 2),
            # 4 shards: the local causal block, then 3 steps of 2 equal-work branches.
            forward_collectives={"collective-permute": 3, "mosaic": 7},
            backward_collectives={"collective-permute": 3},
            control=False,
        ),
        MeshCase(
            "sliding-window ring attention causal GQA 32/8 S4096 window 512 over cp bf16",
            lambda q, k, v: ring.ring_attention(q, k, v, causal=True, sliding_window=512),
            (long_q, long_kv, long_kv),
            (cp, cp, cp),
            ("cp",),
            differentiable=(0, 1, 2),
            # 4 shards of 1024: k and v hop once (steps 2, 3 never meet the window).
            forward_collectives={"collective-permute": 2, "mosaic": 2},
            backward_collectives={"collective-permute": 2},
            control=False,
        ),
    ]
