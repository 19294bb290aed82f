"""Sharding rules of layer_norm: rows split freely, the normalised axis stays whole (its mean and
variance need every column); a replicated weight's and bias's gradients are summed over the
shards by the boundary's transpose."""

from kernel_hub.kernel_api import MeshCase, ShardingRule, sharded

_WHOLE = {
    "whole": ("hidden",),
    "handled_by": {
        "hidden": "an all-gather of x before the norm (the statistics need every column)"
    },
}
LAYER_NORM = ShardingRule.parse("layer_norm", "... hidden, hidden, hidden -> ... hidden", **_WHOLE)
LAYER_NORM_NO_BIAS = ShardingRule.parse(
    "layer_norm_no_bias", "... hidden, hidden -> ... hidden", **_WHOLE
)
LAYER_NORM_NO_AFFINE = ShardingRule.parse(
    "layer_norm_no_affine", "... hidden -> ... hidden", **_WHOLE
)

# Decorators of the public JAX functions in ``api``.
boundary = sharded(LAYER_NORM)
no_bias_boundary = sharded(LAYER_NORM_NO_BIAS)
no_affine_boundary = sharded(LAYER_NORM_NO_AFFINE)


def mesh_cases() -> list[MeshCase]:
    """Rows over a (data, model) mesh with weight and bias; their gradients are all-reduced."""
    import jax
    import jax.numpy as jnp

    from . import api

    hidden = jax.ShapeDtypeStruct((1024,), jnp.bfloat16)
    return [
        MeshCase(
            "rows over data x model bf16",
            lambda x, w, b: api.layer_norm(x, w, b),
            (jax.ShapeDtypeStruct((16, 256, 1024), jnp.bfloat16), hidden, hidden),
            (("data", "model", None), (None,), (None,)),
            ("data", "model"),
            differentiable=(0, 1, 2),
            backward_collectives={"all-reduce": 1},
            # The conventions split rows over data only: x's model split is gathered.
            auto_forward_collectives={"all-gather": 1},
            auto_backward_collectives={"all-gather": 1, "all-reduce": 1},
        )
    ]
