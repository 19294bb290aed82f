"""Sharding rule of gated_activation: rows split freely; the feature axis stays whole, since in
the fused layout (``up=None``) a split would separate gate columns from their up columns."""

from kernel_hub.kernel_api import MeshCase, ShardingRule, sharded

GATED_ACTIVATION = ShardingRule.parse(
    "gated_activation",
    "... i, ... i -> ... i",
    whole=("i",),
    handled_by={"i": "nothing yet: gather the intermediate features first"},
)

boundary = sharded(GATED_ACTIVATION)
"""Decorator of ``api.gated_activation``: shard_map over the mesh its inputs are sharded on."""


def mesh_cases() -> list[MeshCase]:
    """Rows over a (data, model) mesh, separate and fused layouts."""
    import jax
    import jax.numpy as jnp

    from . import api

    arg = jax.ShapeDtypeStruct((16, 256, 1024), jnp.bfloat16)
    return [
        MeshCase(
            "rows over data x model bf16",
            lambda g, u: api.gated_activation(g, u, "silu"),
            (arg, arg),
            (("data", "model", None), ("data", "model", None)),
            ("data", "model"),
            differentiable=(0, 1),
        ),
        MeshCase(
            "fused gate_up, rows over data x model bf16",
            lambda x: api.gated_activation(x, None, "gelu_tanh"),
            (jax.ShapeDtypeStruct((16, 256, 2048), jnp.bfloat16),),
            (("data", "model", None),),
            ("data", "model"),
            differentiable=(0,),
        ),
    ]
