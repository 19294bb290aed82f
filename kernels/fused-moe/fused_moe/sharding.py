"""Sharding rules of fused_experts and fused_moe: tokens split freely (each token's experts are
its own), expert weights stay whole. Splitting experts over devices is expert parallelism
(``expert_parallel.fused_experts_ep`` for decode, the moe-gemm kernel's ``moe_ep``); splitting
the intermediate dimension would need the gate and up halves split alike, which the stacked
[gate; up] layout does not allow."""

from kernel_hub.kernel_api import ShardingRule, sharded

_EP = "expert parallelism: the moe-gemm kernel's moe_ep over an 'ep' mesh axis"
_WEIGHTS = (
    "k",
    "experts",
    "gu",
    "h",
    "i",
    "gu_s",
    "h_s",
    "i_s",
    "h_p",
    "i_p",
    "h_g",
    "i_g",
    "o",
    "p",
)


def _rule(op: str, text: str) -> ShardingRule:
    factors = {f for side in text.replace("->", ",").split(",") for f in side.split()}
    whole = [f for f in _WEIGHTS if f in factors]
    return ShardingRule.parse(op, text, whole=whole, handled_by={"experts": _EP})


def _weights(transposed: bool, quantization: str | None) -> str:
    w = "experts h gu, experts i h" if transposed else "experts gu h, experts h i"
    if quantization == "mxfp4":  # two values per byte along the contraction
        w = "experts gu h_p, experts h i_p"
    bias = "experts gu, experts h"
    scales = {
        "int8": "experts gu, experts h",
        "w8a8": "experts gu, experts h",
        "fp8": "experts gu_s h_s, experts h_s i_s",
        "mxfp4": "experts gu h_g, experts h i_g",
    }.get(quantization, "experts o, experts p")  # None: absent operands (checked by the op)
    return f"{w}, {bias}, {scales}"


def experts_rule(transposed: bool = False, quantization: str | None = None, **options):
    weights = _weights(transposed, quantization)
    return _rule("fused_experts", f"tokens h, tokens k, tokens k, {weights} -> tokens h")


def moe_rule(transposed: bool = False, quantization: str | None = None, **options):
    weights = _weights(transposed, quantization)
    return _rule("fused_moe", f"tokens h, tokens experts, {weights}, experts -> tokens h")


experts_boundary = sharded(experts_rule)
moe_boundary = sharded(moe_rule)
