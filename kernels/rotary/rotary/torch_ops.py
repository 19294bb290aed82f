"""The rotary_embedding torch op, built with kernel-hub's bridge."""

from __future__ import annotations

import torch

from kernel_hub.kernel_api import KernelInputError, jax_op, op_namespace

from . import api


def _no_table_gradients(cos: torch.Tensor, sin: torch.Tensor) -> None:
    """cos and sin come from buffers in every model; the op does not return their gradients,
    so it refuses to drop one silently (checked whatever the grad mode: the check runs below
    autograd, where grad mode is always off)."""
    if cos.requires_grad or sin.requires_grad:
        raise KernelInputError(
            f"{api.OP}: cos or sin requires grad; the torch op gives gradients for q and k only "
            "(compute cos and sin under torch.no_grad() or detach them)"
        )


@jax_op(op_namespace(__name__), api.rotary_embedding, differentiable=("q", "k"))
def rotary_embedding(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    unsqueeze_dim: int = 1,
    interleaved: bool = False,
    upcast: bool = False,
    cast_back: bool = False,
    implementation: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, k) rotated; see ``api.rotary_embedding``."""
    api.check_inputs(q, k, cos, sin, unsqueeze_dim)
    _no_table_gradients(cos, sin)
