"""The ``rotary_pos_emb`` function slot as Hugging Face ``kernels`` loads it: a stateless layer
(``layers.ApplyRotaryPosEmb``) whose forward replaces the ``Func`` module ``kernels`` wraps around
a model's ``apply_rotary_pos_emb``.

``kernels`` swaps by slot name alone, so this layer serves the form most models decorate (Llama's:
``q * cos + rotate_half(q) * sin``, full-width cos/sin, no casts). kernel-hub's own kernelize probes
each model's function instead (``kernel_hub.layers.integrations.rotary_slot``) and picks the form.
"""

from __future__ import annotations

import torch

from kernel_hub.kernel_api import require

from . import api

rotary_embedding = api.rotary_embedding.torch


def _check_full_width(q: torch.Tensor, cos: torch.Tensor) -> None:
    require(
        cos.shape[-1] == q.shape[-1],
        f"rotary_pos_emb: cos/sin are {cos.shape[-1]} wide for a head dim of {q.shape[-1]}; this "
        "layer serves Transformers' rotate-half apply_rotary_pos_emb, whose cos/sin span the "
        "head dim (GPT-OSS's half-width form is not it: use kernel_hub.kernelize, which probes "
        "the model's function)",
    )


class ApplyRotaryPosEmb(torch.nn.Module):
    """``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)`` -> (q, k) rotated, in one op."""

    has_backward = True
    can_torch_compile = True

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        unsqueeze_dim: int = 1,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        _check_full_width(q, cos)
        return rotary_embedding(q, k, cos, sin, unsqueeze_dim)
