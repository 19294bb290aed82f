"""The causal convolution torch ops, built with kernel-hub's bridge. ``causal_conv1d`` is
differentiable in x, weight, bias and the initial state; the decode update is not."""

from __future__ import annotations

import torch

from kernel_hub.kernel_api import jax_op, op_namespace

from . import api

_NAMESPACE = op_namespace(__name__)


@jax_op(
    _NAMESPACE,
    api.causal_conv1d,
    differentiable=("x", "weight", "bias", "initial_state"),
)
def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    activation: str | None = None,
    implementation: str | None = None,
) -> torch.Tensor:
    """y [B, T, D] for x [B, T, D], weight [D, W]; see ``api.causal_conv1d``."""
    api.check_inputs(x, weight, bias, initial_state, cu_seqlens, activation)


@jax_op(_NAMESPACE, api.causal_conv1d_update)
def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    implementation: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [B, T, D], new conv state [B, S, D]); see ``api.causal_conv1d_update``."""
    api.check_update_inputs(x, conv_state, weight, bias, activation)
