"""torch.nn layers kernelize recognises in any model: ``torch.nn.LayerNorm`` (the ``LayerNorm``
layer of the layernorm op; BERT, RoBERTa, ViT, CLIP, Whisper, ModernBERT and Flux use the class
itself) and ``torch.nn.RMSNorm`` (the ``TorchRMSNorm`` layer of the rmsnorm op; Flux's and Wan's
q/k norms).

A subclass counts only if it keeps the class's ``forward`` (Diffusers' ``LayerNorm`` alias does;
``FP32LayerNorm`` does not, see ``integrations.diffusers``).
"""

from __future__ import annotations

import torch

LAYERNORM_LAYER = "LayerNorm"
RMSNORM_LAYER = "TorchRMSNorm"

MODEL_INTERFACES = ()
"""torch.nn has no dispatch tables to switch."""


def recognised_layer(cls: type) -> str | None:
    """The layer name a torch.nn class can be replaced by, or None."""
    if issubclass(cls, torch.nn.LayerNorm) and cls.forward is torch.nn.LayerNorm.forward:
        return LAYERNORM_LAYER
    if issubclass(cls, torch.nn.RMSNorm) and cls.forward is torch.nn.RMSNorm.forward:
        return RMSNORM_LAYER
    return None
