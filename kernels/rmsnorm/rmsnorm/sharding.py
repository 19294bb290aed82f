"""Sharding rule of rms_norm: rows split freely, the normalised axis stays whole."""

from kernel_hub.kernel_api import MeshCase, ShardingRule, sharded

RMS_NORM = ShardingRule.parse(
    "rms_norm",
    "... hidden, hidden -> ... hidden",
    whole=("hidden",),
    handled_by={"hidden": "an all-gather of x before the norm (the statistics need every column)"},
)

boundary = sharded(RMS_NORM)
"""Decorator of ``api.rms_norm``: shard_map over the mesh its inputs are sharded on."""


def mesh_cases() -> list[MeshCase]:
    """Rows over a (data, model) mesh, plain and gated (both norm/gate orders); the weight
    gradient is summed over every shard."""
    import jax
    import jax.numpy as jnp

    from . import api, gated

    x = jax.ShapeDtypeStruct((16, 256, 1024), jnp.bfloat16)
    weight = jax.ShapeDtypeStruct((1024,), jnp.bfloat16)
    rows = ("data", "model", None)
    return [
        MeshCase(
            "rows over data x model bf16",
            api.rms_norm,
            (x, weight),
            (rows, (None,)),
            ("data", "model"),
            differentiable=(0, 1),
            backward_collectives={"all-reduce": 1},
            # The conventions split rows over data only: x's model split is gathered.
            auto_forward_collectives={"all-gather": 1},
            auto_backward_collectives={"all-gather": 1, "all-reduce": 1},
        ),
        *(
            MeshCase(
                f"gated, norm {'before' if before else 'after'} gate, rows over data x model bf16",
                lambda x, z, w, before=before: gated.gated_rms_norm(
                    x, z, w, norm_before_gate=before
                ),
                (x, x, weight),
                (rows, rows, (None,)),
                ("data", "model"),
                differentiable=(0, 1, 2),
                backward_collectives={"all-reduce": 1},
                auto_forward_collectives={"all-gather": 2},
                auto_backward_collectives={"all-gather": 2, "all-reduce": 1},
                xla_backward=True,
            )
            for before in (True, False)
        ),
    ]


GATED_RMS_NORM = ShardingRule.parse(
    "gated_rms_norm",
    "... hidden, ... hidden, hidden -> ... hidden",
    whole=("hidden",),
    handled_by={"hidden": "an all-gather of x and the gate before the norm"},
)

gated_boundary = sharded(GATED_RMS_NORM)
"""Decorator of ``gated.gated_rms_norm``."""
