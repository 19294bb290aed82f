"""Kernelized tiny Llama and Mixtral trained a few SGD steps beside the stock model: under
``torch.compile(backend="aot_eager", fullgraph=True)`` (losses and gradients as eager, f32) and
under ``torch.autocast("cpu", torch.bfloat16)`` with f32 weights, as ``Trainer(bf16=True)`` runs
(bf16 tolerance: the two models round in different places)."""

from __future__ import annotations

import contextlib

import pytest
import torch

pytest.importorskip("transformers")

from kernel_hub.layers.kernelize import kernelize
from kernel_hub.models.tiny import build_tiny_model

STEPS = 3


def _batch():
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    return ids, mask


def _train(model, context, compiled: bool):
    """Losses of ``STEPS`` SGD steps and the last step's gradients."""
    model.train()
    forward = torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ids, mask = _batch()
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        with context():
            loss = forward(input_ids=ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
        optimizer.step()
    return losses, {n: p.grad.clone() for n, p in model.named_parameters()}


def _compare(name, stock, kernelized, loss_tolerance, grad_tolerance):
    (want_losses, want_grads), (got_losses, got_grads) = stock, kernelized
    for step, (want, got) in enumerate(zip(want_losses, got_losses, strict=True)):
        assert abs(got - want) <= loss_tolerance, f"{name} step {step}: loss {got} vs {want}"
    for param, expected in want_grads.items():
        error = ((got_grads[param] - expected).abs().max() / expected.abs().max()).item()
        assert error <= grad_tolerance, f"{name} {param}: gradient relative error {error:.3g}"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "mixtral"])
def test_compiled_fullgraph_training_matches_eager_stock(attention, name):
    stock, model = build_tiny_model(name), build_tiny_model(name)
    report = kernelize(model, mode="training+torch_compile")
    assert {"AttentionInterface", "RMSNorm"} <= set(report.counts()), report
    torch._dynamo.reset()
    want = _train(stock, contextlib.nullcontext, compiled=False)
    got = _train(model, contextlib.nullcontext, compiled=True)
    _compare(name, want, got, loss_tolerance=1e-5, grad_tolerance=1e-4)


@pytest.mark.parametrize("name", ["llama", "mixtral"])
def test_autocast_bf16_training_matches_stock(attention, name):
    stock, model = build_tiny_model(name), build_tiny_model(name)
    kernelize(model, mode="training")

    def autocast():
        return torch.autocast("cpu", torch.bfloat16)

    want = _train(stock, autocast, compiled=False)
    got = _train(model, autocast, compiled=False)
    _compare(name, want, got, loss_tolerance=2e-3, grad_tolerance=5e-2)


def test_eager_models_keep_stock_attention_in_a_compiled_training_kernelize():
    """Eager attention's fully masked rows (left padding) average every value and a training loss
    reads them; with a soft-cap (Gemma 2) kernel-hub follows that backward only after a host
    read torch.compile cannot trace, so a ``training+torch_compile`` kernelize leaves such an
    attention alone, with the reason; a plain training kernelize swaps it. (Without a soft-cap
    the compiled form is exact: ``test_attention_compiled_masks.py``.)"""
    from transformers import Gemma2ForCausalLM

    from kernel_hub import unkernelize
    from kernel_hub.models.tiny import tiny_model

    model = tiny_model(Gemma2ForCausalLM)
    assert model.config._attn_implementation == "eager"
    for mode, swapped in (("training+torch_compile", False), ("training", True)):
        report = kernelize(model, device="cpu", mode=mode)
        entries = [e for e in report.entries if e.target == "AttentionInterface"]
        assert len(entries) == 2 and all(bool(e.swapped) == swapped for e in entries), entries
        if not swapped:
            assert all("torch.compile cannot trace" in e.reason for e in entries), entries
        unkernelize(model)
