"""torch.nn.LayerNorm in Transformers encoders (ViT, ModernBERT's bias=False, CLIP, RoBERTa) is
recognised and swapped to the layernorm kernel; outputs and gradients match stock. Attention stays
stock here (``kernel_mapping``): these tests are about the norms."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    ModernBertConfig,
    ModernBertModel,
    RobertaConfig,
    RobertaModel,
    ViTConfig,
    ViTModel,
)

from kernel_hub import kernel_mapping, kernelize, unkernelize
from kernel_hub.models.tiny import tiny_config
from kernel_hub.testing import max_errors

from .kernelize_helpers import TOLERANCE

TOKENS = {"input_ids": lambda: torch.randint(5, 128, (2, 12))}
MODELS = {
    "vit": (
        ViTModel,
        tiny_config(ViTConfig, image_size=16, patch_size=4),
        {"pixel_values": lambda: torch.randn(2, 3, 16, 16)},
    ),
    "modernbert": (
        ModernBertModel,
        tiny_config(
            ModernBertConfig,
            intermediate_size=96,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            sep_token_id=3,
            cls_token_id=4,
            global_attn_every_n_layers=1,
        ),
        TOKENS,
    ),
    "clip-text": (
        CLIPTextModel,
        tiny_config(
            CLIPTextConfig,
            max_position_embeddings=32,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        ),
        TOKENS,
    ),
    "roberta": (
        RobertaModel,
        tiny_config(
            RobertaConfig,
            max_position_embeddings=40,
            pad_token_id=1,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        ),
        TOKENS,
    ),
}


def outputs_and_grads(model, inputs):
    model.zero_grad()
    out = model(**inputs).last_hidden_state
    out.square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), grads


@pytest.mark.parametrize("name", sorted(MODELS))
def test_layernorms_swapped_and_match_stock(name):
    model_class, config, make_inputs = MODELS[name]
    torch.manual_seed(0)
    model = model_class(config).train()
    inputs = {key: make() for key, make in make_inputs.items()}
    stock_out, stock_grads = outputs_and_grads(model, inputs)

    with kernel_mapping({"attention": "off"}):
        report = kernelize(model, mode="training")
    norms = [e for e in report.entries if e.target == "LayerNorm"]
    assert len(norms) == 5 and all(e.swapped_to for e in norms), report
    out, grads = outputs_and_grads(model, inputs)
    assert max_errors(out, stock_out)[0] <= TOLERANCE
    for param, grad in grads.items():
        scale = max(1.0, float(stock_grads[param].abs().max()))
        assert max_errors(grad, stock_grads[param])[0] <= TOLERANCE * scale, param
    unkernelize(model)
