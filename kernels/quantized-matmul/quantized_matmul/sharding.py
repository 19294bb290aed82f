"""Sharding rule of quantized_matmul: the weight's output dim (``n``, over ``model`` by the
conventions) splits freely; its contraction dim ``k`` (over ``data``) splits with partial
products summed over the shards. Scales follow their weights: int8's [n] holds the output dim;
fp8's block grid [n / 128, k / 128] holds both under the weight's factors, so a split reaches
the scale only when its block count divides too (each shard then holds whole blocks)."""

from kernel_hub.kernel_api import MeshCase, ShardingRule, sharded

_INT8 = ShardingRule.parse("quantized_matmul", "... k, n k, n -> ... n", reduced=("k",))
_FP8 = ShardingRule.parse("quantized_matmul", "... k, n k, n k -> ... n", reduced=("k",))


def rule(ranks: tuple = (), **options) -> ShardingRule:
    """The rule for the scale's rank (1: int8 per channel, 2: fp8 block grid)."""
    return _FP8 if len(ranks) > 2 and ranks[2] == 2 else _INT8


boundary = sharded(rule)
"""Decorator of ``api.quantized_matmul``: shard_map over the mesh its inputs are sharded on."""


def mesh_cases() -> list[MeshCase]:
    """Weight out dim over model, k over data (partial sums: one all-reduce), scales following;
    int8 and fp8."""
    import jax
    import jax.numpy as jnp

    from . import api

    x = jax.ShapeDtypeStruct((8, 1024), jnp.bfloat16)
    return [
        MeshCase(
            f"quantized_matmul {fmt} n over model, k over data",
            lambda x, weight, scale: api.quantized_matmul(x, weight, scale),
            (
                x,
                jax.ShapeDtypeStruct((1024, 1024), dtype),
                jax.ShapeDtypeStruct(scale_shape, jnp.float32),
            ),
            ((None, "data"), ("model", "data"), scale_spec),
            ("data", "model"),
            differentiable=(0,),
            forward_collectives={"all-reduce": 1},
            # No mesh-axis convention splits a weight's k: the inputs are gathered to the
            # conventional placement instead of summing partial products.
            auto_forward_collectives={"all-gather": 1},
            auto_backward_collectives={"all-gather": 1},
            xla_backward=True,  # the activations' gradient is XLA's (whole dequantized weight)
        )
        for fmt, dtype, scale_shape, scale_spec in (
            ("int8", jnp.int8, (1024,), ("model",)),
            ("fp8", jnp.float8_e4m3fn, (8, 8), ("model", "data")),
        )
    ]
