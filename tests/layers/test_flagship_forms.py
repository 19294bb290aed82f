"""The norm and MLP forms of the newest flagship models (Llama 4, Gemma 4, Falcon-H1): recognised
by their probes, near misses refused, and swapped models matching stock in values and gradients.

Each near miss differs from a served form in one detail (the flag inverted, Llama's rounding
under a flag, a multiplier moved or dropped, the activation under another name), so a probe
that accepted it would be caught here.
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm, Gemma4VisionMLP
from transformers.models.llama4.modeling_llama4 import Llama4TextMLP, Llama4TextRMSNorm

from kernel_hub import kernel_mapping, kernelize, unkernelize
from kernel_hub.layers.integrations import transformers as hf
from kernel_hub.models.coverage import EXACT, run_coverage
from kernel_hub.testing import registry_with_ops


def _transformers_class(name: str, base: type, forward) -> type:
    """A class that looks like Transformers' own (so the recognisers decide about it)."""
    return type(name, (base,), {"forward": forward, "__module__": "transformers.models.fake"})


def _flag_inverted(self, hidden_states):
    out = self._norm(hidden_states.float())
    if not self.with_scale:
        out = out * self.weight.float()
    return out.type_as(hidden_states)


def _flag_with_llama_rounding(self, hidden_states):
    out = self._norm(hidden_states.float()).type_as(hidden_states)
    return out * self.weight if self.with_scale else out


def _flag_off_still_scaled(self, hidden_states):
    out = self._norm(hidden_states.float())
    return (out * (self.weight.float() if self.with_scale else 2.0)).type_as(hidden_states)


@pytest.mark.parametrize(
    "forward", [_flag_inverted, _flag_with_llama_rounding, _flag_off_still_scaled]
)
def test_scale_flag_near_misses_are_refused(forward) -> None:
    recognition = hf.recognise_norm(_transformers_class("FlagRMSNorm", Gemma4RMSNorm, forward))
    assert recognition.layer is None and "none of the RMSNorm forms" in recognition.reason


def test_flagship_norms_and_mlps_are_recognised() -> None:
    assert hf.recognise_norm(Gemma4RMSNorm).layer == "RMSNormOptionalScale"
    assert hf.recognise_norm(Llama4TextRMSNorm).layer == "RMSNormOfX"
    assert hf.recognise_gated_mlp(Llama4TextMLP).layer == "GatedMLPActivationFn"
    assert hf.recognise_gated_mlp(Gemma4VisionMLP).layer == "GatedMLP"
    from transformers.models.falcon_h1.modeling_falcon_h1 import FalconH1MLP

    assert hf.recognise_gated_mlp(FalconH1MLP).layer == "ScaledGatedMLP"


def _multiplier_inside_activation(self, x):  # act(gate) * gate_multiplier: Falcon scales first
    y = self.up_proj(x) * (self.act_fn(self.gate_proj(x)) * self.gate_multiplier)
    return self.down_proj(y) * self.down_multiplier


def _down_multiplier_dropped(self, x):
    return self.down_proj(self.up_proj(x) * self.act_fn(self.gate_proj(x) * self.gate_multiplier))


def _down_multiplier_before_projection(self, x):
    y = self.up_proj(x) * self.act_fn(self.gate_proj(x) * self.gate_multiplier)
    return self.down_proj(y * self.down_multiplier)


def _activation_on_up(self, x):
    return self.down_proj(self.gate_proj(x) * self.activation_fn(self.up_proj(x)))


@pytest.mark.parametrize(
    "forward",
    [
        _multiplier_inside_activation,
        _down_multiplier_dropped,
        _down_multiplier_before_projection,
        _activation_on_up,
    ],
)
def test_mlp_near_misses_are_refused(forward) -> None:
    cls = _transformers_class("NearMissMLP", torch.nn.Module, forward)
    assert hf.is_gated_mlp_candidate(cls)
    recognition = hf.recognise_gated_mlp(cls)
    assert recognition.layer is None, recognition


class _Holder(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


def _norms() -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    norms = {
        "llama4": Llama4TextRMSNorm(48, eps=1e-5),
        "gemma4 with_scale": Gemma4RMSNorm(48, eps=1e-6),
        "gemma4 without scale": Gemma4RMSNorm(48, eps=1e-6, with_scale=False),
    }
    for norm in norms.values():
        for weight in norm.parameters():
            torch.nn.init.normal_(weight, 0.5, 0.5)
    return norms


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(_norms()))
def test_swapped_flagship_norms_match_stock_forward_and_gradients(
    name: str, dtype: torch.dtype
) -> None:
    model = _Holder(_norms()[name].to(dtype))
    x = torch.randn(3, 5, 48).to(dtype)

    def run():
        xi = x.clone().requires_grad_()
        out = model(xi)
        out.float().pow(2).sum().backward()
        grads = [xi.grad] + [p.grad for p in model.parameters()]
        model.zero_grad()
        return out.detach(), grads

    stock, stock_grads = run()
    report = kernelize(model, mode="training")
    assert len(report.swapped) == 1, str(report)
    got, got_grads = run()
    unkernelize(model)
    assert got.dtype == stock.dtype
    if dtype == torch.bfloat16:
        assert torch.equal(got, stock)  # the same rounding points: bit for bit
    else:
        torch.testing.assert_close(got, stock, rtol=0, atol=2e-6)
    tolerance = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {}
    for mine, theirs in zip(got_grads, stock_grads, strict=True):
        torch.testing.assert_close(mine, theirs, **tolerance)


def test_gemma4_norm_flags_are_checked_per_module() -> None:
    norm = Gemma4RMSNorm(16, with_scale=False)
    norm.register_buffer("scale", torch.ones(16))
    (entry,) = kernelize(_Holder(norm), mode="inference").entries
    assert not entry.swapped and "with_scale is False but it holds" in entry.reason
    norm = Gemma4RMSNorm(16)
    norm.with_scale = 1
    (entry,) = kernelize(_Holder(norm), mode="inference").entries
    assert not entry.swapped and "with_scale is 1, not True or False" in entry.reason


class _Config:
    hidden_size, intermediate_size, hidden_activation = 32, 64, "gelu_pytorch_tanh"
    use_clipped_linears = True


def test_clippable_linear_projections_are_served_by_calling_them() -> None:
    """Gemma 4's vision MLP: clamp, linear, clamp per projection. The layer calls the host's
    projections, so finite clip bounds that bite give the stock result too."""
    torch.manual_seed(0)
    mlp = Gemma4VisionMLP(_Config())
    for projection in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
        projection.input_min.fill_(-0.5)
        projection.output_max.fill_(0.01)
    model = _Holder(mlp)
    x = torch.randn(2, 7, 32)

    def run():
        xi = x.clone().requires_grad_()
        out = model(xi)
        out.pow(2).sum().backward()
        grads = [xi.grad] + [p.grad for p in model.parameters()]
        model.zero_grad()
        return out.detach(), grads

    stock, stock_grads = run()
    assert (stock == 0.01).any()  # the output clip bites
    with kernel_mapping({"attention": "off"}):
        report = kernelize(model, mode="training")
    assert [e.swapped_to for e in report.entries if e.swapped], str(report)
    got, got_grads = run()
    unkernelize(model)
    torch.testing.assert_close(got, stock, rtol=1e-5, atol=1e-6)
    for mine, theirs in zip(got_grads, stock_grads, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)


def test_flagship_tiny_models_swap_the_new_forms_and_match_stock(tmp_path) -> None:
    """Only the norm, MLP and MoE kernels in the registry: every new form swapped (Llama 4's MoE
    blocks, top-2 of 4 experts here, on moe-gemm), and each model's training outputs and every
    gradient as stock's."""
    registry = registry_with_ops(tmp_path, "rmsnorm", "gated-mlp", "moe-gemm")
    results = run_coverage(
        "training", model_types=["llama4", "gemma4_text", "falcon_h1"], registry=registry
    )
    by_type = {r.model_type: r for r in results}
    want = {
        "llama4": {"RMSNormOfX": 5, "GatedMLPActivationFn": 2, "InputScaledMoE": 2},
        "gemma4_text": {"RMSNormOptionalScale": 18, "GatedMLP": 2},
        "falcon_h1": {"ScaledGatedMLP": 2, "RMSNorm": 5},
    }
    for model_type, swapped in want.items():
        result = by_type[model_type]
        assert result.status == EXACT, result
        assert {k: result.swapped.get(k) for k in swapped} == swapped, result.swapped
