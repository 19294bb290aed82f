"""Sharding rules of gmm and tgmm. Rows and experts stay whole: group sizes describe the global
row order, so splitting either is expert parallelism (``expert_parallel.moe_ep``). gmm may split
its output columns ``n`` and its contraction ``k`` (partial products summed over the shards);
tgmm splits ``k`` and ``n`` freely."""

from kernel_hub.kernel_api import MeshCase, ShardingRule, sharded

_EP = "expert parallelism: moe_gemm.expert_parallel.moe_ep over an 'ep' mesh axis"
_WHOLE = {"whole": ("rows", "experts"), "handled_by": {"rows": _EP, "experts": _EP}}

GMM = ShardingRule.parse("gmm", "rows k, experts k n, experts -> rows n", reduced=("k",), **_WHOLE)
GMM_TRANSPOSED = ShardingRule.parse(
    "gmm", "rows k, experts n k, experts -> rows n", reduced=("k",), **_WHOLE
)
TGMM = ShardingRule.parse("tgmm", "rows k, rows n, experts -> experts k n", **_WHOLE)


def gmm_rule(transpose_rhs: bool = False, **options) -> ShardingRule:
    """gmm's rule for its rhs layout ([E, k, n], or [E, n, k] with ``transpose_rhs``)."""
    return GMM_TRANSPOSED if transpose_rhs else GMM


# The backward functions: gmm's dlhs sums over n, tgmm's gradients over k and n, so those stay
# whole there.
_GMM_VJP = ShardingRule.parse(
    "gmm_vjp",
    "rows k, experts k n, experts, rows n -> rows k, experts k n",
    whole=("rows", "experts", "n"),
    handled_by=_WHOLE["handled_by"],
)
_GMM_VJP_TRANSPOSED = ShardingRule.parse(
    "gmm_vjp",
    "rows k, experts n k, experts, rows n -> rows k, experts n k",
    whole=("rows", "experts", "n"),
    handled_by=_WHOLE["handled_by"],
)
TGMM_VJP = ShardingRule.parse(
    "tgmm_vjp",
    "rows k, rows n, experts, experts k n -> rows k, rows n",
    whole=("rows", "experts", "k", "n"),
    handled_by=_WHOLE["handled_by"],
)


def gmm_vjp_rule(transpose_rhs: bool = False, **options) -> ShardingRule:
    """gmm_vjp's rule for its rhs layout."""
    return _GMM_VJP_TRANSPOSED if transpose_rhs else _GMM_VJP


# Decorators of the public JAX functions in ``api``.
gmm_boundary = sharded(gmm_rule)
tgmm_boundary = sharded(TGMM)
gmm_vjp_boundary = sharded(gmm_vjp_rule)
tgmm_vjp_boundary = sharded(TGMM_VJP)


def mesh_cases() -> list[MeshCase]:
    """gmm with k split (partial products summed: all-reduce) and n split; tgmm with k x n."""
    import functools

    import jax
    import jax.numpy as jnp

    from . import api, expert_parallel

    rows = jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((8,), jnp.int32)
    return [
        MeshCase(
            "gmm k x n bf16",
            lambda lhs, rhs, s: api.gmm(lhs, rhs, s),
            (rows, jax.ShapeDtypeStruct((8, 1024, 1024), jnp.bfloat16), sizes),
            ((None, "data"), (None, "data", "model"), (None,)),
            ("data", "model"),
            differentiable=(0, 1),
            forward_collectives={"all-reduce": 1},
            # No mesh-axis convention splits k or n: both inputs are gathered whole.
            auto_forward_collectives={"all-gather": 2},
            auto_backward_collectives={"all-gather": 2},
        ),
        MeshCase(
            "expert-parallel MoE E16 top-2 bf16 (ragged_all_to_all)",
            functools.partial(
                expert_parallel.moe_ep, activation=expert_parallel.swiglu, transport="ragged"
            ),
            (
                jax.ShapeDtypeStruct((1024, 512), jnp.bfloat16),
                jax.ShapeDtypeStruct((1024, 2), jnp.int32),
                jax.ShapeDtypeStruct((1024, 2), jnp.bfloat16),
                jax.ShapeDtypeStruct((16, 512, 512), jnp.bfloat16),
                jax.ShapeDtypeStruct((16, 256, 512), jnp.bfloat16),
            ),
            (("ep",),) * 5,
            ("ep",),
            differentiable=(0, 3, 4),
            forward_collectives={"ragged-all-to-all": 2, "all-gather": 1},
            backward_collectives={"ragged-all-to-all": 2},
            control=False,
        ),
        MeshCase(
            "tgmm k x n bf16",
            lambda lhs, grad, s: api.tgmm(lhs, grad, s),
            (rows, rows, sizes),
            ((None, "data"), (None, "model"), (None,)),
            ("data", "model"),
            auto_forward_collectives={"all-gather": 2},
        ),
    ]
