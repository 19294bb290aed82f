"""A tiny Qwen3-Next (and Qwen3.5) kernelized: the gated-delta-net mixers and gated norms are
swapped, logits and training gradients equal stock on a padded batch, greedy generation (prefill,
then cached one-token decode through the recurrent op) equals stock token for token."""

from __future__ import annotations

import copy

import pytest
import torch

from kernel_hub import kernelize
from kernel_hub.models.demo import demo_batch, greedy
from kernel_hub.models.tiny import tiny_model
from kernel_hub.testing import count_slot_calls

pytestmark = pytest.mark.slow


def tiny_qwen3_next(linear_head_dim: int = 16) -> torch.nn.Module:
    from transformers import Qwen3NextForCausalLM

    model = tiny_model(
        Qwen3NextForCausalLM,
        num_hidden_layers=4,
        head_dim=16,
        intermediate_size=96,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        linear_num_key_heads=2,
        linear_num_value_heads=4,  # grouped: two value heads per q/k head
        linear_key_head_dim=linear_head_dim,
        linear_value_head_dim=linear_head_dim,
        linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "full_attention"] * 2,
        max_position_embeddings=128,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=None,
    )
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:  # norm weights, A_log, dt_bias: away from their init
                param.normal_(1.0, 0.2)
    return model


def swapped_to(report, suffix):
    return sorted(e.module for e in report.swapped if e.swapped_to.endswith(suffix))


def test_inference_logits_and_greedy_generation_equal_stock():
    stock = tiny_qwen3_next()
    model = copy.deepcopy(stock)
    report = kernelize(model, mode="inference")
    assert swapped_to(report, "layers.GatedDeltaNet") == [
        "model.layers.0.linear_attn",
        "model.layers.2.linear_attn",
    ]
    assert len(swapped_to(report, "layers.RMSNormGated")) == 2
    slots = [e.module for e in report.entries if e.kind == "function slots" and e.swapped]
    assert slots == ["model.layers.0.linear_attn", "model.layers.2.linear_attn"]
    calls = count_slot_calls(model, ("causal_conv1d_fn", "causal_conv1d_update"))
    batch = demo_batch(length=70, padding=5)  # crosses the 64-token chunk; one row left-padded
    with torch.no_grad():
        want, got = stock(**batch).logits, model(**batch).logits
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(got[real], want[real], rtol=0, atol=1e-4)
    assert torch.equal(greedy(model, demo_batch(), 12), greedy(stock, demo_batch(), 12))
    assert calls["causal_conv1d_fn"] and calls["causal_conv1d_update"], calls


def test_stock_mixers_keep_their_convolution_with_the_reason():
    """A mixer GatedDeltaNet refuses keeps its stock forward, which calls the module-level
    convolution functions: the slots are not filled there, and the report says why."""
    model = tiny_qwen3_next()
    model.model.layers[0].linear_attn.activation = "gelu"
    report = kernelize(model, mode="inference")
    entries = {e.module: e for e in report.entries if e.kind == "function slots"}
    assert entries["model.layers.2.linear_attn"].swapped
    assert "calls the module-level" in entries["model.layers.0.linear_attn"].reason
    assert "causal_conv1d_fn" not in model.model.layers[0].linear_attn.__dict__


def test_training_gradients_equal_stock():
    """Loss gradients with the mixers swapped, at Qwen3-Next's linear head size (128): the
    backward that once deadlocked XLA's CPU pool here (see ``chunked.py``)."""
    stock = tiny_qwen3_next(linear_head_dim=128).train()
    model = copy.deepcopy(stock)
    report = kernelize(model, mode="training")
    assert swapped_to(report, "layers.GatedDeltaNet") == [
        "model.layers.0.linear_attn",
        "model.layers.2.linear_attn",
    ]
    assert all(e.swapped for e in report.entries if e.kind == "function slots")
    calls = count_slot_calls(model, ("causal_conv1d_fn", "causal_conv1d_update"))
    batch = demo_batch(length=70, padding=5)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    stock(**batch, labels=labels).loss.backward()
    model(**batch, labels=labels).loss.backward()
    mixer_grads = 0
    for (name, want), got in zip(stock.named_parameters(), model.parameters(), strict=True):
        if want.grad is not None:
            torch.testing.assert_close(got.grad, want.grad, rtol=0, atol=1e-4, msg=name)
            mixer_grads += "linear_attn" in name and bool(want.grad.abs().max() > 0)
    assert mixer_grads > 0
    assert calls["causal_conv1d_fn"] == 2


def test_packed_sequences_are_refused_and_other_mixers_left_alone():
    from kernel_hub import get_kernel

    gdr = get_kernel("gated-delta-rule")
    model = tiny_qwen3_next()
    mixer = model.model.layers[0].linear_attn
    assert gdr.KERNEL.module_checks["GatedDeltaNet"](mixer) is None
    hidden = torch.randn(1, 6, 64)
    with pytest.raises(NotImplementedError, match="packed sequences"):
        gdr.layers.GatedDeltaNet.forward(mixer, hidden, cu_seq_lens_q=torch.tensor([0, 2, 6]))
    mixer.activation = "gelu"
    assert "activation is 'gelu'" in gdr.KERNEL.module_checks["GatedDeltaNet"](mixer)


def test_qwen3_5_mixer_is_swapped_and_exact():
    """Qwen3.5's mixer (separate q/k/v, z, b, a projections) through the same layer."""
    from kernel_hub.models import architectures

    arch = next(a for a in architectures.architectures() if a.model_type == "qwen3_5_text")
    stock = architectures.build(arch)
    model = copy.deepcopy(stock)
    report = kernelize(model, mode="inference")
    assert swapped_to(report, "layers.GatedDeltaNet")
    batch = demo_batch(length=70, padding=5)
    with torch.no_grad():
        want, got = stock(**batch).logits, model(**batch).logits
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(got[real], want[real], rtol=0, atol=1e-4)
    assert torch.equal(greedy(model, demo_batch(), 12), greedy(stock, demo_batch(), 12))


def test_continuous_batching_is_left_alone_with_the_reason():
    """Transformers' batching cache keeps no recurrent or conv state per request: stock
    generate_batch refuses linear-attention layers, so kernelize does not switch it on."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    model = tiny_qwen3_next()
    config = GenerationConfig(max_new_tokens=2, do_sample=False, eos_token_id=-1, pad_token_id=0)
    batching = ContinuousBatchingConfig(num_blocks=8, max_batch_tokens=16, page_size=16)
    with pytest.raises(ValueError, match="Invalid layer type: linear_attention"):
        model.generate_batch(
            [[3, 4, 5]], generation_config=config, continuous_batching_config=batching
        )
    report = kernelize(model, mode="inference")
    entries = [e for e in report.entries if e.kind == "continuous batching"]
    assert entries and not any(e.swapped for e in entries)
    assert all("holds no linear_attention layers" in e.reason for e in entries)
    assert "init_continuous_batching" not in model.__dict__
