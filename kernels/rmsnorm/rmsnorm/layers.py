"""Layers whose ``forward`` replaces a Transformers layer's forward (state read from the host)."""

from __future__ import annotations

import torch

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
