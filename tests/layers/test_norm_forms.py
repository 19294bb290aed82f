"""The norm recogniser accepts a class only when its math is one a kernel layer computes exactly.

Near-miss classes differ from a served form in one detail each (eps placement, a bias, the
weight offset's dtype, the cast order, extra state); none may be recognised. Served forms must
then match stock through kernelize, for f32 and bf16.
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

from kernel_hub import kernelize, unkernelize
from kernel_hub.layers.integrations.transformers import recognise_norm


def _transformers_class(name: str, base: type, forward) -> type:
    """A class that looks like Transformers' own (so the recogniser decides about it)."""
    return type(name, (base,), {"forward": forward, "__module__": "transformers.models.fake"})


def _x32(x):
    return x.to(torch.float32)


def _eps_outside(self, hidden_states):  # eps added after the rsqrt
    h = _x32(hidden_states)
    h = h * (torch.rsqrt(h.pow(2).mean(-1, keepdim=True)) + self.variance_epsilon)
    return self.weight * h.to(hidden_states.dtype)


def _no_eps(self, hidden_states):
    h = _x32(hidden_states)
    return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True))).to(hidden_states.dtype)


def _with_bias(self, hidden_states):
    return LlamaRMSNorm.forward(self, hidden_states) + self.bias


def _offset_in_weight_dtype(self, x):  # (1 + w).float(), not 1 + w.float()
    out = self._norm(x.float()) * (1.0 + self.weight).float()
    return out.type_as(x)


def _cast_before_scale(self, hidden_states):  # GPT-OSS's layout but Llama's cast: rounds twice
    h = _x32(hidden_states)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return (self.weight * h.to(hidden_states.dtype)).to(hidden_states.dtype)


def _mean_centered(self, hidden_states):  # a LayerNorm without bias
    h = _x32(hidden_states)
    h = h - h.mean(-1, keepdim=True)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * h.to(hidden_states.dtype)


def _reads_a_flag(self, hidden_states):
    out = LlamaRMSNorm.forward(self, hidden_states)
    return out * 2 if self.scale_output else out


def _sum_not_mean(self, hidden_states):
    h = _x32(hidden_states)
    h = h * torch.rsqrt(h.pow(2).sum(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * h.to(hidden_states.dtype)


def _gemma_norm(self, x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


NEAR_MISSES = {
    "eps outside rsqrt": (LlamaRMSNorm, _eps_outside),
    "no eps": (LlamaRMSNorm, _no_eps),
    "bias": (LlamaRMSNorm, _with_bias),
    "mean-centred": (LlamaRMSNorm, _mean_centered),
    "sum instead of mean": (LlamaRMSNorm, _sum_not_mean),
    "cast before scale, then again": (GptOssRMSNorm, _cast_before_scale),
    "1 + w in the weight dtype": (GemmaRMSNorm, _offset_in_weight_dtype),
    "reads another attribute": (LlamaRMSNorm, _reads_a_flag),
}


@pytest.mark.parametrize("miss", NEAR_MISSES, ids=str)
def test_near_miss_classes_are_never_recognised(miss: str) -> None:
    base, forward = NEAR_MISSES[miss]
    namespace = {"_norm": _gemma_norm} if base is GemmaRMSNorm else {}
    cls = _transformers_class("NearMissRMSNorm", base, forward)
    for name, fn in namespace.items():
        setattr(cls, name, fn)
    recognition = recognise_norm(cls)
    assert recognition.layer is None, f"{miss} recognised as {recognition.layer}"
    assert "none of the RMSNorm forms" in recognition.reason


@pytest.mark.parametrize(
    ("cls", "layer"),
    [
        (LlamaRMSNorm, "RMSNorm"),
        (GptOssRMSNorm, "RMSNormF32Scale"),
        (Olmo2RMSNorm, "RMSNormF32Scale"),
        (GemmaRMSNorm, "RMSNormZeroCentered"),
    ],
)
def test_served_forms_are_recognised(cls: type, layer: str) -> None:
    assert recognise_norm(cls).layer == layer


class _Holder(torch.nn.Module):
    def __init__(self, norm: torch.nn.Module):
        super().__init__()
        self.norm = norm

    def forward(self, x):
        return self.norm(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "cls", [LlamaRMSNorm, GptOssRMSNorm, GemmaRMSNorm], ids=lambda c: c.__name__
)
def test_swapped_norms_match_stock_dtype_and_values(cls: type, dtype: torch.dtype) -> None:
    norm = cls(64, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_(0.5, 0.5)
    model = _Holder(norm.to(dtype))
    x = torch.randn(3, 5, 64).to(dtype)
    stock = model(x)
    report = kernelize(model, mode="inference")
    assert len(report.swapped) == 1, str(report)
    got = model(x)
    unkernelize(model)
    assert got.dtype == stock.dtype
    if dtype == torch.bfloat16:
        assert torch.equal(got, stock)  # the same rounding points: bit for bit
    else:
        torch.testing.assert_close(got, stock, rtol=0, atol=2e-6)


def test_a_norm_with_a_bias_or_extra_state_is_left_alone() -> None:
    norm = LlamaRMSNorm(16)
    norm.register_buffer("scale", torch.ones(16))
    report = kernelize(_Holder(norm), mode="inference")
    (entry,) = report.entries
    assert not entry.swapped and "scale (buffer)" in entry.reason

    norm = LlamaRMSNorm(16)
    norm.bias = torch.nn.Parameter(torch.zeros(16))
    (entry,) = kernelize(_Holder(norm), mode="inference").entries
    assert not entry.swapped and "bias (parameter)" in entry.reason


def test_an_unrecognised_transformers_norm_is_reported_with_the_reason() -> None:
    cls = _transformers_class("OddRMSNorm", LlamaRMSNorm, _eps_outside)
    (entry,) = kernelize(_Holder(cls(16)), mode="inference").entries
    assert not entry.swapped and entry.target == "RMSNorm"
    assert "none of the RMSNorm forms" in entry.reason


def test_the_probe_decides_over_an_active_transformers_decorator() -> None:
    from kernel_hub.layers.kernelize import find_mark

    marked = type("GptOssRMSNorm", (GptOssRMSNorm,), {"kernel_layer_name": "RMSNorm"})
    marked.__module__ = GptOssRMSNorm.__module__  # what use_kernel_forward_from_hub would set
    assert find_mark(marked(8)) == ("RMSNormF32Scale", "recognised")
