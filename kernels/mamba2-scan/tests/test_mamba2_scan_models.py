"""Tiny Mamba-2 family models kernelized: every Mamba-2 mixer is swapped to ``Mamba2ScanMixer``
(its own forward, the scan slots on this kernel's ops, the convolution slots on causal-conv1d's,
filled per module), logits and training gradients equal stock on a padded batch crossing the
scan's chunks, greedy generation (prefill through the chunked op, cached one-token decode through
the decode op) equals stock token for token."""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch

from kernel_hub import get_kernel, kernelize
from kernel_hub.models import architectures
from kernel_hub.models.demo import demo_batch, greedy
from kernel_hub.testing import count_slot_calls

pytestmark = pytest.mark.slow

m2 = get_kernel("mamba2-scan")
CHUNK = 16  # set on every mixer (stock and kernelized) so the 40-token batch crosses chunks


def tiny(model_type: str) -> torch.nn.Module:
    arch = next(a for a in architectures.architectures() if a.model_type == model_type)
    model = architectures.build(arch)
    for module in model.modules():
        if hasattr(module, "chunk_size") and hasattr(module, "A_log"):
            module.chunk_size = CHUNK
    return model


def mixers(report) -> list[str]:
    return sorted(e.module for e in report.swapped if e.swapped_to.endswith("Mamba2ScanMixer"))


def count_conv_calls(model) -> dict[str, int]:
    """Count calls of the convolution functions kernelize put in the mixers' slots."""
    return count_slot_calls(model, m2.layers.CONV_SLOTS)


class Calls:
    """Counts the slot calls that reach this kernel's torch ops."""

    def __init__(self):
        self.patches = [
            mock.patch.object(m2.layers, name, wraps=getattr(m2.layers, name))
            for name in ("mamba_chunk_scan_combined", "selective_state_update")
        ]

    def __enter__(self):
        self.chunk, self.decode = (p.start() for p in self.patches)
        return self

    def __exit__(self, *exc):
        for p in self.patches:
            p.stop()


# CI time: two of the six here (Mamba-2's own mixer; Falcon-H1's, with its multipliers and the
# decode z gate); all six run exact in `kernel-hub models` (inference and training).
@pytest.mark.parametrize("model_type", ["mamba2", "falcon_h1"])
def test_inference_logits_and_greedy_generation_equal_stock(model_type):
    stock = tiny(model_type)
    model = copy.deepcopy(stock)
    report = kernelize(model, mode="inference")
    expected = [
        name
        for name, module in model.named_modules()
        if type(module).__name__ in m2_mixer_classes()
    ]
    assert expected and mixers(report) == sorted(expected)
    slots = [e.module for e in report.entries if e.kind == "function slots" and e.swapped]
    assert slots == sorted(expected)
    conv = count_conv_calls(model)
    assert not any(n in m.__dict__ for m in stock.modules() for n in conv)  # stock keeps its own
    batch = demo_batch(length=40, padding=5)
    with torch.no_grad(), Calls() as calls:
        want, got = stock(**batch).logits, model(**batch).logits
        assert calls.chunk.call_count == len(expected)
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(got[real], want[real], rtol=0, atol=1e-4)
    with Calls() as calls:
        tokens = greedy(model, demo_batch(), 12)
        # one call per mixer and decoded token (a row may stop early at the tiny EOS id)
        assert calls.decode.call_count and calls.decode.call_count % len(expected) == 0
    assert torch.equal(tokens, greedy(stock, demo_batch(), 12))
    assert conv["causal_conv1d_fn"] and conv["causal_conv1d_update"], conv


def m2_mixer_classes() -> set[str]:
    from kernel_hub.layers.integrations.transformers import MIXERS

    return {cls for cls, layer in MIXERS.items() if layer == "Mamba2ScanMixer"}


@pytest.mark.parametrize("model_type", ["bamba"])
def test_training_gradients_equal_stock(model_type):
    stock = tiny(model_type).train()
    model = copy.deepcopy(stock)
    report = kernelize(model, mode="training")
    assert mixers(report)
    batch = demo_batch(length=40, padding=5)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    stock(**batch, labels=labels).loss.backward()
    conv = count_conv_calls(model)
    with Calls() as calls:
        model(**batch, labels=labels).loss.backward()
        assert calls.chunk.call_count == len(mixers(report))
    assert conv["causal_conv1d_fn"] == len(mixers(report))
    for (name, want), got in zip(stock.named_parameters(), model.parameters(), strict=True):
        if want.grad is not None:
            torch.testing.assert_close(got.grad, want.grad, rtol=0, atol=1e-4, msg=name)


def test_slots_refuse_what_the_fallback_refuses_or_cannot_match():
    x = torch.randn(1, 8, 4, 16)
    args = (
        x,
        torch.randn(1, 8, 4),
        -torch.ones(4),
        torch.randn(1, 8, 1, 8),
        torch.randn(1, 8, 1, 8),
    )
    seq_idx = torch.zeros(1, 8, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"packed sequences \(seq_idx\)"):
        m2.layers.chunk_scan_slot(*args, 16, seq_idx=seq_idx)
    with pytest.raises(NotImplementedError, match="z gate"):
        m2.layers.chunk_scan_slot(*args, 16, z=x)
    # keyword arguments the fallback does not name are dropped, as its wrapper drops them
    y = m2.layers.chunk_scan_slot(*args, 16, position_ids=torch.arange(8))
    assert y.shape == x.shape and y.dtype == torch.float32
    conv = m2.layers._conv_slot(lambda *a, **k: "ran")
    with pytest.raises(ValueError, match=r"packed sequences \(seq_idx\)"):
        conv(x, x, None, activation="silu", seq_idx=seq_idx)
    assert conv(x, x, None, activation="silu", position_ids=torch.arange(8)) == "ran"


def test_module_check_names_what_is_missing():
    check = m2.KERNEL.module_checks["Mamba2ScanMixer"]
    model = tiny("mamba2")
    assert check(model.backbone.layers[0].mixer) is None

    class Other(torch.nn.Module):
        def forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
            return hidden_states

    Other.__module__ = type(model.backbone.layers[0].mixer).__module__
    assert "calls neither mamba2_chunk_scan nor" in check(Other())
