"""The gated delta rule torch ops, built with kernel-hub's bridge. Both return (o, final state);
gradients flow to q, k, v, g, beta and the initial state."""

from __future__ import annotations

import torch

from kernel_hub.kernel_api import jax_op, op_namespace

from . import api

_NAMESPACE = op_namespace(__name__)
_DIFFERENTIABLE = ("q", "k", "v", "g", "beta", "initial_state")


@jax_op(_NAMESPACE, api.chunk_gated_delta_rule, differentiable=_DIFFERENTIABLE)
def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
    use_qk_l2norm: bool = False,
    scale: float | None = None,
    implementation: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o [B, T, HV, V], final states [N, HV, K, V] f32); see ``api.chunk_gated_delta_rule``."""
    api.check_inputs(api.CHUNK_OP, q, k, v, g, beta, initial_state, cu_seqlens)


@jax_op(_NAMESPACE, api.recurrent_gated_delta_rule, differentiable=_DIFFERENTIABLE)
def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    use_qk_l2norm: bool = False,
    scale: float | None = None,
    implementation: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o [B, T, HV, V], new state [B, HV, K, V] f32); see ``api.recurrent_gated_delta_rule``."""
    api.check_inputs(api.DECODE_OP, q, k, v, g, beta, initial_state)
