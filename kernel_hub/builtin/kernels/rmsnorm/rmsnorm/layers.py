"""Layers whose ``forward`` replaces a Transformers layer's forward (state read from the host)."""

from __future__ import annotations

import torch

from kernel_hub.kernel_api import FLOATS_AND_F64, dtype_name

from .torch_ops import rms_norm


class RMSNorm(torch.nn.Module):
    """Replaces ``*RMSNorm.forward`` (Llama, Mistral, Mixtral, Qwen2, ...).

    Reads ``weight`` and ``variance_epsilon`` (or ``eps``) from the module it is swapped into.
    Not for Gemma-style norms that scale by ``1 + weight``.
    """

    can_torch_compile = True
    has_backward = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        eps = getattr(self, "variance_epsilon", None)
        if eps is None:
            eps = getattr(self, "eps", 1e-6)
        return rms_norm(hidden_states, self.weight, float(eps))


def _rmsnorm_module_problem(module: torch.nn.Module) -> str | None:
    """Why ``RMSNorm.forward`` cannot run on ``module``'s state, or None (used by kernelize)."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor):
        return "the module has no weight tensor"
    if weight.dim() != 1:
        return f"weight has shape {tuple(weight.shape)}; a 1-D weight is needed"
    dtype = dtype_name(weight.dtype)
    if dtype not in FLOATS_AND_F64:
        return f"weight has dtype {dtype}; supported: {', '.join(FLOATS_AND_F64)}"
    if weight.device.type == "meta":
        return "weight is on the meta device (not loaded)"
    eps = getattr(module, "variance_epsilon", None)
    if eps is None:
        eps = getattr(module, "eps", 1e-6)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        return f"variance_epsilon/eps is {eps!r}, not a number"
    return None


MODULE_CHECKS = {"RMSNorm": _rmsnorm_module_problem}
"""Layer name -> check of the host module's state; kernelize leaves modules that fail alone."""
