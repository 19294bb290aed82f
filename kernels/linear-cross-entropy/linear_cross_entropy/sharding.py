"""Sharding rule of the token statistics: tokens split freely (data parallel); the hidden and
vocabulary axes stay whole (a vocabulary-parallel loss would combine per-shard log-sum-exps)."""

from kernel_hub.kernel_api import MeshCase, ShardingRule, sharded

TOKEN_STATISTICS = ShardingRule.parse(
    "token_statistics",
    "tokens hidden, vocab hidden, vocab, tokens -> tokens, tokens, tokens",
    whole=("hidden", "vocab"),
    handled_by={"vocab": "nothing yet: gather the LM head weight (vocabulary-parallel loss)"},
)

boundary = sharded(TOKEN_STATISTICS)
"""Decorator of ``api.token_statistics``: shard_map over the mesh its inputs are sharded on."""


def mesh_cases() -> list[MeshCase]:
    """The loss with tokens over a (data, model) mesh; the head's gradient is summed."""
    import jax
    import jax.numpy as jnp

    from . import api

    return [
        MeshCase(
            "tokens over data x model bf16",
            lambda h, w, labels: api.linear_cross_entropy(h, w, labels),
            (
                jax.ShapeDtypeStruct((2048, 512), jnp.bfloat16),
                jax.ShapeDtypeStruct((4096, 512), jnp.bfloat16),
                jax.ShapeDtypeStruct((2048,), jnp.int32),
            ),
            (("data", None), (None, None), ("data",)),
            ("data", "model"),
            differentiable=(0, 1),
            backward_collectives={"all-reduce": 1},
        )
    ]
