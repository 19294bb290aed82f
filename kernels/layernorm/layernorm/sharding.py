"""Sharding rules of layer_norm: rows split freely, the normalised axis stays whole (its mean and
variance need every column); a replicated weight's and bias's gradients are summed over the
shards by the boundary's transpose."""

from kernel_hub.kernel_api import ShardingRule, sharded

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
