"""Layers whose ``forward`` replaces a Transformers layer's forward (state read from the host)."""

from __future__ import annotations

import torch

from .integrations import experts_forward


class MoEExperts(torch.nn.Module):
    """Replaces the ``forward`` of Transformers' 3D-weight experts modules (``MixtralExperts``,
    ``Qwen2MoeExperts``, ``Qwen3MoeExperts``, ...): the experts run through ``gmm``.

    Reads ``num_experts``, ``gate_up_proj`` / ``up_proj``, ``down_proj``, ``act_fn`` (and biases
    and layout flags when present) from the module it is swapped into.
    """

    can_torch_compile = True
    has_backward = True

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        return experts_forward(self, hidden_states, top_k_index, top_k_weights)
