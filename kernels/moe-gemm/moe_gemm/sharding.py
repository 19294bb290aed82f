"""Sharding rules of gmm and tgmm. Rows and experts stay whole: group sizes describe the global
row order, so splitting either is expert parallelism (``expert_parallel.moe_ep``). gmm may split
its output columns ``n`` and its contraction ``k`` (partial products summed over the shards);
tgmm splits ``k`` and ``n`` freely."""

from kernel_hub.kernel_api import ShardingRule, sharded

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


# gmm_quantized: the weight [E, out, in] is read as [E, n, k] (transpose_rhs, a projection's
# forward) or [E, k, n]; its scale follows the weight's split. int8's per-channel scale [E, out]
# (rank 2) holds the out dim; fp8's block scale [E, out / 128, in / 128] (rank 3) holds both
# block dims under the weight's factors, so a split of out (or in) reaches the scale only when
# its block count divides too (each shard then holds whole blocks); otherwise the solver refuses
# the placement, naming the scale (an Auto mesh's conventional placement keeps it whole instead).
_QUANTIZED_LAYOUT = {True: ("n k", "n"), False: ("k n", "k")}


def _quantized_rule(op: str, transpose_rhs: bool, ranks: tuple, backward: bool) -> ShardingRule:
    weight, int8_scale = _QUANTIZED_LAYOUT[transpose_rhs]
    scale = weight if len(ranks) > 2 and ranks[2] == 3 else int8_scale
    operands = f"rows k, experts {weight}, experts {scale}, experts"
    if backward:  # d lhs = d out @ W: the other contraction, partial products summed over n
        return ShardingRule.parse(op, f"{operands}, rows n -> rows k", reduced=("n",), **_WHOLE)
    return ShardingRule.parse(op, f"{operands} -> rows n", reduced=("k",), **_WHOLE)


def gmm_quantized_rule(transpose_rhs: bool = True, ranks: tuple = (), **options) -> ShardingRule:
    """gmm_quantized's rule for the weight's layout and its scale's rank (2: int8, 3: fp8)."""
    return _quantized_rule("gmm_quantized", transpose_rhs, ranks, backward=False)


def gmm_quantized_vjp_rule(
    transpose_rhs: bool = True, ranks: tuple = (), **options
) -> ShardingRule:
    """gmm_quantized_vjp's rule (operands lhs, weight, scale, group_sizes, dout)."""
    return _quantized_rule("gmm_quantized_vjp", transpose_rhs, ranks, backward=True)


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
gmm_quantized_boundary = sharded(gmm_quantized_rule)
gmm_quantized_vjp_boundary = sharded(gmm_quantized_vjp_rule)
