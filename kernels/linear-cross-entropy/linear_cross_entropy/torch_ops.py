"""The linear_cross_entropy torch op, built with kernel-hub's bridge."""

from __future__ import annotations

import torch

from kernel_hub.kernel_api import jax_op, op_namespace

from . import api


@jax_op(
    op_namespace(__name__),
    api.linear_cross_entropy,
    differentiable=("hidden", "weight", "bias"),
    autocast=("hidden", "weight", "bias"),
)
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
    """Cross-entropy of the LM head's logits without materialising them: hidden [N, H], weight
    [V, H], labels [N] (already shifted); a float32 scalar, or [N] for ``reduction="none"``. See
    ``api.linear_cross_entropy``."""
    api.check_inputs(
        hidden,
        weight,
        labels,
        bias,
        ignore_index=ignore_index,
        reduction=reduction,
        label_smoothing=label_smoothing,
        logit_scale=logit_scale,
        softcap=softcap,
        z_loss=z_loss,
    )
