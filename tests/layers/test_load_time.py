"""Load-time use: from_pretrained + kernelize, models built from configs, saving kernelized."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

import kernel_hub
from kernel_hub.models.demo import demo_batch
from kernel_hub.models.tiny import build_tiny_model

from .kernelize_helpers import TOLERANCE, TmpHub, max_masked_diff, swapped_modules


def logits(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**batch).logits


def test_from_pretrained_loads_and_kernelizes(tmp_path: Path) -> None:
    stock = build_tiny_model("llama")
    stock.save_pretrained(tmp_path)
    model = kernel_hub.from_pretrained(AutoModelForCausalLM, tmp_path, mode="inference")
    assert type(model) is type(stock)
    # RMSNorms, gated MLPs, and attention forwards carrying the rotary slot
    assert len(swapped_modules(model)) == 5 + 2 + 2
    batch = demo_batch()
    assert max_masked_diff(logits(model, batch), logits(stock, batch), batch["attention_mask"]) <= (
        TOLERANCE
    )


def test_model_built_from_a_config_is_kernelized() -> None:
    stock = build_tiny_model("mixtral")
    model = AutoModelForCausalLM.from_config(stock.config)
    model.load_state_dict(stock.state_dict())
    model.eval()
    report = kernel_hub.kernelize(model)
    assert report.counts()["RMSNorm"] == 5
    batch = demo_batch()
    assert max_masked_diff(logits(model, batch), logits(stock, batch), batch["attention_mask"]) <= (
        TOLERANCE
    )


def test_kernelized_model_saves_as_a_stock_model(tmp_path: Path, tmp_hub: TmpHub) -> None:
    registry = tmp_hub.all_kinds_registry()
    stock = build_tiny_model("mixtral")
    model = copy.deepcopy(stock)
    report = kernel_hub.kernelize(model, registry=registry)
    assert report.counts() == {
        "RMSNorm": 5,
        "AttentionInterface": 2,
        "ExpertsInterface": 2,
        "ContinuousBatching": 2,
    }
    model.save_pretrained(tmp_path / "saved")

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert swapped_modules(reloaded) == []
    assert reloaded.config._attn_implementation == stock.config._attn_implementation
    assert reloaded.config._experts_implementation == stock.config._experts_implementation
    expected, saved = stock.state_dict(), reloaded.state_dict()
    assert expected.keys() == saved.keys()
    assert all(torch.equal(expected[k], saved[k]) for k in expected)
    batch = demo_batch()
    assert torch.equal(logits(reloaded.eval(), batch), logits(stock, batch))
