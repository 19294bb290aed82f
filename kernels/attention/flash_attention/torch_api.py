"""The torch ops (declared with their JAX functions in ``api`` and ``dense_mask``) and
``dot_product_attention``, which picks between two of them.

``attention_with_lse`` and ``attention_with_dense_mask`` return (out, logsumexp) so the backward
reuses the forward's saved outputs instead of recomputing it; ``attention_forward_only`` returns
out alone, so a program that takes no gradient (inference) writes no logsumexp.
``dropout_seed`` draws the seed the integrations pass with attention dropout.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from . import api, dense_mask

attention_with_lse = api.dot_product_attention_with_lse.torch
attention_forward_only = api.dot_product_attention.torch
attention_with_dense_mask = dense_mask.attention_with_dense_mask.torch


def dropout_seed(device: torch.device | str) -> torch.Tensor:
    """A fresh dropout seed (int32 scalar on ``device``) drawn from torch's default CPU
    generator: ``torch.manual_seed`` reproduces a run's masks, and every call draws another."""
    return torch.randint(torch.iinfo(torch.int32).max, (), dtype=torch.int32).to(device)


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
