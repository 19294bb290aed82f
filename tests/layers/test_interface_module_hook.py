"""``integrations.module_problem``: an integration leaves a model's interface alone, with the
reason in every module's report entry (the attention kernel refuses sinks, a position bias, MLA)."""

from __future__ import annotations

import torch

from kernel_hub import kernelize
from kernel_hub.models import architectures as archs


def _model(model_type: str, family: str = "decoder") -> torch.nn.Module:
    (arch,) = [a for a in archs.architectures((family,)) if a.model_type == model_type]
    for variant in archs.CONFIG_VARIANTS:
        model = archs.build(arch, variant)
        try:
            with torch.no_grad():
                model(**archs.batch(arch, model))
            return model
        except Exception:
            continue
    raise AssertionError(f"{model_type} does not run")


def _attention_entries(report):
    return [e for e in report.entries if e.target == "AttentionInterface"]


def test_attention_sinks_leave_gpt_oss_attention_alone() -> None:
    model = _model("gpt_oss")
    entries = _attention_entries(kernelize(model, mode="inference"))
    assert entries and all(not e.swapped and "sinks" in e.reason for e in entries)
    assert model.config._attn_implementation != "kernel_hub_attention"


def test_a_position_bias_leaves_t5_attention_alone() -> None:
    entries = _attention_entries(kernelize(_model("t5", "encoder-decoder"), mode="inference"))
    assert entries and all(not e.swapped and "position_bias" in e.reason for e in entries)


def test_mla_head_dims_leave_deepseek_v3_attention_alone() -> None:
    entries = _attention_entries(kernelize(_model("deepseek_v3"), mode="inference"))
    assert entries and all(not e.swapped and "value head dim" in e.reason for e in entries)


def test_a_model_without_sdpa_and_a_non_causal_layer_keeps_its_attention() -> None:
    model = _model("pegasus_x", "encoder-decoder")
    entries = _attention_entries(kernelize(model, mode="inference"))
    assert entries and all(not e.swapped and "_supports_sdpa = False" in e.reason for e in entries)
