"""kernelize next to Hugging Face ``kernels``: refused when it manages the model; the report is
rebuilt from the swaps in place, so a later HF kernelize cannot make it lie."""

from __future__ import annotations

import types

import pytest
import torch

from kernel_hub import KernelHubError, kernelize, kernelize_report, unkernelize
from kernel_hub.models.tiny import build_tiny_model


def _hf_kernelize_fallback(model: torch.nn.Module) -> None:
    """What ``kernels.kernelize`` does to a layer it has no kernel for: the class's own forward
    assigned on the instance (``kernels/layer/layer.py`` ``_replace_forward``)."""
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = types.MethodType(type(module).forward, module)


def test_a_model_managed_by_hf_kernels_is_refused() -> None:
    model = build_tiny_model("llama")
    model._use_kernels = True  # what from_pretrained(use_kernels=True) leaves
    with pytest.raises(KernelHubError, match=r"use_kernels=True.*re-kernelizes"):
        kernelize(model, mode="inference")


def test_hf_kernelize_after_kernel_hub_shows_in_the_report() -> None:
    model = build_tiny_model("llama")
    report = kernelize(model, mode="inference")
    assert report.counts()["RMSNorm"] == 5
    _hf_kernelize_fallback(model)
    now = kernelize_report(model)
    assert "RMSNorm" not in now.counts() and now.counts()["AttentionInterface"] == 2
    undone = [e for e in now.left_alone if e.target == "RMSNorm"]
    assert len(undone) == 5 and all("forward was replaced since" in e.reason for e in undone)
    restored = unkernelize(model)
    assert "model.norm" not in restored  # HF's forward stays; only the interface is restored
    assert all("forward" in m.__dict__ for m in model.modules() if "RMSNorm" in type(m).__name__)


def test_kernelize_after_hf_fallback_swaps_and_restores_its_forward() -> None:
    model = build_tiny_model("llama")
    _hf_kernelize_fallback(model)
    previous = model.model.norm.__dict__["forward"]
    assert kernelize(model, mode="inference").counts()["RMSNorm"] == 5
    unkernelize(model)
    assert model.model.norm.__dict__["forward"] is previous


def test_a_kernel_forward_from_elsewhere_is_left_alone() -> None:
    model = build_tiny_model("llama")
    model.model.norm.forward = lambda hidden_states: hidden_states
    report = kernelize(model, mode="inference")
    (entry,) = [e for e in report.entries if e.module == "model.norm"]
    assert not entry.swapped and "already replaced on the instance" in entry.reason


def test_the_report_says_so_after_unkernelize_and_before_any_kernelize() -> None:
    model = build_tiny_model("llama")
    with pytest.raises(KernelHubError, match="never kernelized"):
        kernelize_report(model)
    kernelize(model, mode="inference")
    unkernelize(model)
    assert kernelize_report(model).swapped == ()
