"""The torch ops (declared with their JAX functions in ``api``) and ``linear_cross_entropy``,
which picks between them.

``linear_cross_entropy_per_token`` returns (loss per token, log-sum-exp per token) so its backward
starts from the saved statistics (one backward kernel, no forward kernel again: four N x V x H
matmul passes in a torch training step, as in a JAX one); the op named ``linear_cross_entropy``
returns the reduced loss alone, so a call that takes no gradient writes no statistics.
"""

from __future__ import annotations

import torch

from . import api
from .reference import REDUCTIONS

linear_cross_entropy_per_token = api.linear_cross_entropy_per_token.torch
loss_only = api.linear_cross_entropy.torch


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    z_loss: float = 0.0,
    implementation: str | None = None,
) -> torch.Tensor:
    """The ``linear_cross_entropy`` op's loss (same arguments). When autograd will differentiate
    it: ``linear_cross_entropy_per_token``'s losses, reduced here as ``reference.
    loss_from_statistics`` reduces them (a mean over the tokens not ignored: NaN when all are)."""
    needs_gradient = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden, weight, bias)
    )
    options = (label_smoothing, logit_scale, softcap, z_loss, implementation)
    if not needs_gradient or reduction not in REDUCTIONS:  # the op refuses a bad reduction
        return loss_only(hidden, weight, labels, bias, ignore_index, reduction, *options)
    losses, _ = linear_cross_entropy_per_token(hidden, weight, labels, bias, ignore_index, *options)
    if reduction == "none":
        return losses
    total = losses.sum()
    return total if reduction == "sum" else total / (labels != ignore_index).sum()
