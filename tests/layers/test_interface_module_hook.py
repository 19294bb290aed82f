"""``integrations.module_problem``: an integration leaves a model's interface alone, with the
reason in every module's report entry; and the SDPA-convention rule of the Transformers
attention interface."""

from __future__ import annotations

import pytest
import torch

from kernel_hub import get_kernel, kernelize
from kernel_hub.models import architectures as archs
from kernel_hub.models.tiny import build_tiny_model


def _attention_entries(report):
    return [e for e in report.entries if e.target == "AttentionInterface"]


def test_module_problem_leaves_the_whole_models_attention_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    integrations = get_kernel("attention").KERNEL.integration("transformers")

    def refuse_layer_one(module: torch.nn.Module) -> str | None:
        return "layer 1 needs a feature" if module.layer_idx == 1 else None

    monkeypatch.setattr(integrations, "module_problem", refuse_layer_one, raising=False)
    model = build_tiny_model("llama")
    report = kernelize(model, mode="inference")
    entries = _attention_entries(report)
    assert len(entries) == 2 and all(not e.swapped for e in entries)
    assert all("layer 1 needs a feature" in e.reason for e in entries)
    assert model.config._attn_implementation != "kernel_hub_attention"
    assert report.counts()["RMSNorm"] == 5  # the layers are swapped all the same


def test_a_model_without_sdpa_and_a_non_causal_layer_keeps_its_attention() -> None:
    (arch,) = [a for a in archs.architectures(("encoder-decoder",)) if a.model_type == "pegasus_x"]
    model = archs.build(arch)
    entries = _attention_entries(kernelize(model, mode="inference"))
    assert entries and all(not e.swapped and "_supports_sdpa = False" in e.reason for e in entries)
