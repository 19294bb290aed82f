"""Torch ops, built with kernel-hub's bridge. ``attention_with_lse`` and
``attention_with_dense_mask`` return (out, logsumexp) so the backward reuses the forward's saved
outputs instead of recomputing it; ``attention_forward_only`` returns out alone, so a program that
takes no gradient (inference) writes no logsumexp. ``dot_product_attention`` picks between the
first and the last.

The ops' options are ``AttentionSpec``'s fields (``option_stub`` derives them): the 1.0 options
follow the 1.0 tensors, tensor arguments added in 1.1 (``sinks``, ``bias``) and 1.2 (positions,
groups) and options added since come last, so positional calls written for 1.0 keep their meaning.
The bridge hands the JAX functions (forward and backward) the stub's tensors by position, and
the sharding rules describe operands by position: ``jax_op`` checks both by name when the ops are
defined.

Under ``torch.autocast`` query, key and value are cast to the autocast dtype, as autocast casts
SDPA's inputs (so f32 q/k from RoPE and a bf16 v meet in one dtype); masks, sinks and biases keep
theirs (scores and softmax run in f32 whatever the input dtype).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from kernel_hub.kernel_api import SavedBackward, jax_op, op_namespace, option_stub

from . import api, dense_mask
from .options import TORCH_1_0, AttentionSpec

_NAMESPACE = op_namespace(__name__)
_QKV = ("query", "key", "value")
_SAVED = ("out", "lse", "d_out", "d_lse")


@jax_op(
    _NAMESPACE,
    api.dot_product_attention_with_lse,
    differentiable=(*_QKV, "sinks"),
    jax_backward=SavedBackward(api.attention_backward, _SAVED),
    autocast=_QKV,
)
@option_stub(AttentionSpec, leading=TORCH_1_0, after="kv_segment_ids")
def attention_with_lse(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_mask: torch.Tensor | None = None,
    q_segment_ids: torch.Tensor | None = None,
    kv_segment_ids: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    q_positions: torch.Tensor | None = None,
    kv_positions: torch.Tensor | None = None,
    q_groups: torch.Tensor | None = None,
    kv_groups: torch.Tensor | None = None,
    *,
    options: AttentionSpec,
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
    )


@jax_op(_NAMESPACE, api.dot_product_attention, differentiable=(*_QKV, "sinks"), autocast=_QKV)
@option_stub(AttentionSpec, leading=TORCH_1_0, after="kv_segment_ids")
def attention_forward_only(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_mask: torch.Tensor | None = None,
    q_segment_ids: torch.Tensor | None = None,
    kv_segment_ids: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    q_positions: torch.Tensor | None = None,
    kv_positions: torch.Tensor | None = None,
    q_groups: torch.Tensor | None = None,
    kv_groups: torch.Tensor | None = None,
    *,
    options: AttentionSpec,
) -> torch.Tensor:
    """``attention_with_lse``'s out [B, Hq, Sq, Dv] alone: no logsumexp is written. For programs
    that take no gradient; its backward (``jax.vjp``) would rerun the forward, so
    ``dot_product_attention`` sends calls that need one to ``attention_with_lse``."""
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
    )


def needs_gradient(*args: Any, **kwargs: Any) -> bool:
    """Whether autograd will differentiate a call with these arguments."""
    return torch.is_grad_enabled() and any(
        isinstance(a, torch.Tensor) and a.requires_grad for a in (*args, *kwargs.values())
    )


def dot_product_attention(*args: Any, **kwargs: Any) -> torch.Tensor:
    """Attention output [B, Hq, Sq, Dv] for q [B, Hq, Sq, D], k [B, Hkv, Sk, D],
    v [B, Hkv, Sk, Dv], same arguments as ``attention_with_lse``: its output when a gradient is
    needed (the backward reuses the saved logsumexp), else ``attention_forward_only``'s."""
    if needs_gradient(*args, **kwargs):
        return attention_with_lse(*args, **kwargs)[0]
    return attention_forward_only(*args, **kwargs)


dot_product_attention.__signature__ = inspect.signature(attention_with_lse)  # type: ignore[attr-defined]


@jax_op(
    _NAMESPACE,
    dense_mask.attention_with_dense_mask,
    differentiable=(*_QKV, "sinks", "bias"),
    jax_backward=SavedBackward(dense_mask.attention_with_dense_mask_backward, _SAVED),
    autocast=_QKV,
)
@option_stub(
    AttentionSpec, exclude=dense_mask.UNUSED_OPTIONS, leading=TORCH_1_0, after="attention_mask"
)
def attention_with_dense_mask(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor,
    sinks: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    *,
    options: AttentionSpec,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, logsumexp) under a dense [B|1, H|1, Sq, Sk] mask (bool or additive); the kernel runs
    when the mask is key padding + the causal/window rule or packed segments, see ``dense_mask``.
    ``sinks`` [Hq] and an additive ``bias`` [B|1, H|1, Sq, Sk] are differentiable."""
    api.check_inputs(query, key, value, sinks=sinks)
    dense_mask.check_mask(query, key, attention_mask)
    if bias is not None:
        dense_mask.check_bias(query, key, bias)
