"""The Mamba-2 scan torch ops, built with kernel-hub's bridge. The chunked scan returns
(y, final states) with gradients to every float input; the decode step returns (y, new state)
and has no backward (decode is inference)."""

from __future__ import annotations

import torch

from kernel_hub.kernel_api import jax_op, op_namespace

from . import api

_NAMESPACE = op_namespace(__name__)


@jax_op(
    _NAMESPACE,
    api.mamba_chunk_scan_combined,
    differentiable=("x", "dt", "A", "B", "C", "D", "dt_bias", "initial_states"),
)
def mamba_chunk_scan_combined(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    chunk_size: int = 256,
    dt_softplus: bool = False,
    dt_min: float = 0.0,
    dt_max: float | None = None,
    implementation: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [B, L, H, P] f32, final states [B, H, P, N] f32); see
    ``api.mamba_chunk_scan_combined``."""
    api.check_chunk_inputs(x, dt, A, B, C, D, dt_bias, initial_states, seq_idx)


@jax_op(_NAMESPACE, api.selective_state_update)
def selective_state_update(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    implementation: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [B, H, P] in x's dtype, new state in state's dtype); see
    ``api.selective_state_update``. The op returns the new state; callers holding a cache tensor
    copy it over (``layers`` does, as Transformers' fallback does in place)."""
    api.check_decode_inputs(state, x, dt, A, B, C, D, z, dt_bias)
