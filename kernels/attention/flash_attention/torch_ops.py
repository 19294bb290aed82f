"""Torch ops, built with kernel-hub's bridge. Both return (out, logsumexp) so the backward reuses
the forward's saved outputs instead of recomputing it. Tensor arguments added in 1.1 (``sinks``,
``bias``) and 1.2 (positions, groups) come last, so positional calls written for 1.0 keep their
meaning. The bridge hands the JAX functions the stub's tensors by position, and the sharding rules
describe operands by position: ``_contract`` checks, when the ops are defined, that the stub's
tensor parameters, the JAX functions' leading parameters and the rules' operands are the same
list, by name and count.

Under ``torch.autocast`` query, key and value are cast to the autocast dtype, as autocast casts
SDPA's inputs (so f32 q/k from RoPE and a bf16 v meet in one dtype); masks, sinks and biases keep
theirs (scores and softmax run in f32 whatever the input dtype).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch

from kernel_hub.kernel_api import jax_op, op_namespace

from . import api, dense_mask, sharding

_NAMESPACE = op_namespace(__name__)
_QKV = ("query", "key", "value")
_TOKENS = ("q_positions", "kv_positions", "q_groups", "kv_groups")


def _tensor_names(stub) -> tuple[str, ...]:
    return tuple(
        p.name
        for p in inspect.signature(stub, eval_str=True).parameters.values()
        if "Tensor" in str(p.annotation)
    )


def _leading(fn, count: int) -> tuple[str, ...]:
    return tuple(inspect.signature(fn).parameters)[:count]


def _contract(jax_fn, backward_fn, rules: Sequence = (), saved: Sequence[str] = ()):
    """Decorator of a stub: its tensor parameters must be ``jax_fn``'s leading parameters and,
    followed by ``saved`` (the outputs and cotangents), ``backward_fn``'s; each rule in ``rules``
    (forward rule, backward rule) has one operand per tensor, plus ``saved`` for the backward."""

    def check(stub):
        names = _tensor_names(stub)
        wanted = {jax_fn: names, backward_fn: (*names, *saved)}
        for fn, expected in wanted.items():
            found = _leading(fn, len(expected))
            if found != expected:
                raise TypeError(
                    f"{stub.__name__}: the stub's tensors {expected} are passed by position, but "
                    f"{fn.__name__} takes {found}"
                )
        for rule, expected in zip(rules, (names, (*names, *saved)), strict=False):
            if len(rule.operands) != len(expected):
                raise TypeError(
                    f"{stub.__name__}: sharding rule {rule.op} has {len(rule.operands)} "
                    f"operands for the {len(expected)} tensors {expected}"
                )
        return stub

    return check


_SAVED = ("out", "lse", "d_out", "d_lse")


def _attention_backward(inputs, outputs, cotangents, **static):
    return api.attention_backward(
        inputs["query"],
        inputs["key"],
        inputs["value"],
        inputs["kv_mask"],
        inputs["q_segment_ids"],
        inputs["kv_segment_ids"],
        inputs["sinks"],
        *(inputs[name] for name in _TOKENS),
        *outputs,
        *cotangents,
        **static,
    )


@jax_op(
    _NAMESPACE,
    api.dot_product_attention_with_lse,
    differentiable=(*_QKV, "sinks"),
    jax_backward=_attention_backward,
    autocast=_QKV,
)
@_contract(
    api.dot_product_attention_with_lse,
    api.attention_backward,
    (sharding.ATTENTION_WITH_LSE, sharding.ATTENTION_BACKWARD),
    _SAVED,
)
def attention_with_lse(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_mask: torch.Tensor | None = None,
    q_segment_ids: torch.Tensor | None = None,
    kv_segment_ids: torch.Tensor | None = None,
    causal: bool = False,
    sliding_window: int | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    implementation: str | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    sinks: torch.Tensor | None = None,
    q_positions: torch.Tensor | None = None,
    kv_positions: torch.Tensor | None = None,
    q_groups: torch.Tensor | None = None,
    kv_groups: torch.Tensor | None = None,
    window_bounds_groups: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, Hq, Sq, Dv], logsumexp [B, Hq, Sq] f32); see ``api.dot_product_attention``."""
    api.check_inputs(
        query,
        key,
        value,
        kv_mask,
        q_segment_ids,
        kv_segment_ids,
        sinks,
        q_positions,
        kv_positions,
        q_groups,
        kv_groups,
        sliding_window=sliding_window,
        softcap=softcap,
        scale=scale,
    )


def dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_mask: torch.Tensor | None = None,
    q_segment_ids: torch.Tensor | None = None,
    kv_segment_ids: torch.Tensor | None = None,
    causal: bool = False,
    sliding_window: int | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    implementation: str | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention output [B, Hq, Sq, Dv] for q [B, Hq, Sq, D], k [B, Hkv, Sk, D],
    v [B, Hkv, Sk, Dv]; see ``api.dot_product_attention`` for the options."""
    return attention_with_lse(
        query,
        key,
        value,
        kv_mask,
        q_segment_ids,
        kv_segment_ids,
        causal,
        sliding_window,
        softcap,
        scale,
        implementation,
        block_q,
        block_k,
        sinks,
    )[0]


def _dense_mask_backward(inputs, outputs, cotangents, **static):
    return dense_mask.attention_with_dense_mask_backward(
        inputs["query"],
        inputs["key"],
        inputs["value"],
        inputs["attention_mask"],
        inputs["sinks"],
        inputs["bias"],
        *outputs,
        *cotangents,
        **static,
    )


@jax_op(
    _NAMESPACE,
    dense_mask.attention_with_dense_mask,
    differentiable=(*_QKV, "sinks", "bias"),
    jax_backward=_dense_mask_backward,
    autocast=_QKV,
)
@_contract(
    dense_mask.attention_with_dense_mask,
    dense_mask.attention_with_dense_mask_backward,
    saved=_SAVED,
)
def attention_with_dense_mask(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor,
    causal: bool = False,
    sliding_window: int | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    implementation: str | None = None,
    sinks: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, logsumexp) under a dense [B|1, H|1, Sq, Sk] mask (bool or additive); the kernel runs
    when the mask is key padding + the causal/window rule or packed segments, see ``dense_mask``.
    ``sinks`` [Hq] and an additive ``bias`` [B|1, H|1, Sq, Sk] are differentiable."""
    api.check_inputs(
        query, key, value, sinks=sinks, sliding_window=sliding_window, softcap=softcap, scale=scale
    )
    dense_mask.check_mask(query, key, attention_mask)
    if bias is not None:
        dense_mask.check_bias(query, key, bias)
