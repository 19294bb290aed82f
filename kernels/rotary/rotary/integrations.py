"""Transformers adapter: the function kernel-hub puts in the ``rotary_pos_emb`` slot (a model's
``apply_rotary_pos_emb``) once its probe has matched the model's function to one of the
kernel's forms (``kernel_hub.layers.integrations.rotary_slot``)."""

from __future__ import annotations

import torch

from . import api

rotary_embedding = api.rotary_embedding.torch

NAME = "kernel-hub-rotary"
can_torch_compile = True
has_backward = True
module_problem = None  # kernel-hub's rotary slot probes each model's function before switching


def register() -> str:
    return NAME


def apply_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    unsqueeze_dim: int = 1,
    *,
    interleaved: bool = False,
    upcast: bool = False,
    cast_back: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)`` of the form the options name."""
    return rotary_embedding(q, k, cos, sin, unsqueeze_dim, interleaved, upcast, cast_back)
