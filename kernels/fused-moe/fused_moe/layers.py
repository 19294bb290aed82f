"""Layers whose ``forward`` replaces a Transformers layer's forward (state read from the host)."""

from __future__ import annotations

import torch

from .integrations import experts_forward


class FusedMoEExperts(torch.nn.Module):
    """Replaces the ``forward`` of Transformers' 3D-weight experts modules for serving: the
    experts run through the fused kernel (forward only). Reads ``gate_up_proj``, ``down_proj``,
    optional biases and quantization scales, the layout flags and ``_apply_gate`` from the
    module it is swapped into."""

    can_torch_compile = False
    has_backward = False

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        return experts_forward(self, hidden_states, top_k_index, top_k_weights)
