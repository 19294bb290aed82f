"""The rms_norm torch op, built with kernel-hub's bridge."""

from __future__ import annotations

import torch

from kernel_hub.bridge import jax_op, op_namespace

from . import api


@jax_op(op_namespace(__name__), api.rms_norm, differentiable=("x", "weight"))
def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, implementation: str | None = None
) -> torch.Tensor:
    """RMSNorm over the last dimension of ``x``, scaled by ``weight``; see ``api.rms_norm``."""
    api.check_inputs(x, weight)
