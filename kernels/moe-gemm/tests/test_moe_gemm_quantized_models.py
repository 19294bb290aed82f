"""Quantized experts kernelized for training: a tiny Qwen3-MoE whose experts were quantized
(``kernel_hub.quantize_experts``, int8 per channel and fp8 128x128 blocks) runs its experts
through ``gmm_quantized`` with the weights still quantized, and its logits and the gradients of
every trainable parameter equal stock Transformers on the dequantized weights."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import kernel_hub as kh  # noqa: E402
from kernel_hub import get_kernel  # noqa: E402
from kernel_hub.models.tiny import tiny_model  # noqa: E402

moe = get_kernel("moe-gemm")
formats = get_kernel("fused-moe").KERNEL.integration("transformers").quantized
SCALE_NAMES = {"int8": "_scale", "fp8": "_scale_inv"}


def _qwen3_128():
    """Tiny Qwen3-MoE with whole 128x128 blocks (hidden and expert width 128), f32."""
    from transformers import Qwen3MoeForCausalLM

    return tiny_model(Qwen3MoeForCausalLM, hidden_size=128, moe_intermediate_size=128,
                      num_experts=8, num_experts_per_tok=2, head_dim=32, num_hidden_layers=2,
                      pad_token_id=0)  # fmt: skip


def _experts(model) -> list[tuple[str, torch.nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if n.endswith(".experts")]


def _quantized_and_reference(quantization: str):
    """(model with quantized experts, stock model holding their dequantized weights, frozen)."""
    model = _qwen3_128()
    reference = copy.deepcopy(model)
    report = kh.quantize_experts(model, quantization)
    assert report.errors and not report.left_alone, report
    model.set_experts_implementation("eager")  # undo quantize_experts' switch to fused-moe
    for name, module in _experts(model):
        target = reference.get_submodule(name)
        for projection in ("gate_up_proj", "down_proj"):
            scale = getattr(module, projection + SCALE_NAMES[quantization])
            w = formats.dequantize_weight(getattr(module, projection), scale, quantization)
            setattr(target, projection, torch.nn.Parameter(w, requires_grad=False))
    return model, reference


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_training_kernelize_runs_quantized_experts_exactly(quantization):
    model, reference = _quantized_and_reference(quantization)
    held = [(m.gate_up_proj.data_ptr(), m.down_proj.data_ptr()) for _, m in _experts(model)]
    report = kh.kernelize(model.train(), mode="training")
    experts = [e for e in report.entries if e.kind == "experts"]
    assert experts and all(e.swapped for e in experts), report
    ids = torch.randint(2, 128, (2, 9), generator=torch.Generator().manual_seed(4))
    calls = []
    original = moe.integrations.gmm_quantized

    def recording(*args, **kwargs):
        calls.append(args[1].dtype)
        return original(*args, **kwargs)

    moe.integrations.gmm_quantized = recording
    try:
        loss = model(ids, labels=ids).loss
    finally:
        moe.integrations.gmm_quantized = original
    assert len(calls) == 4 and all(d.itemsize == 1 for d in calls), calls
    loss.backward()
    expected_loss = reference.train()(ids, labels=ids).loss
    expected_loss.backward()
    assert abs(loss.item() - expected_loss.item()) <= 1e-5
    stock = dict(reference.named_parameters())
    checked = 0
    for name, parameter in model.named_parameters():
        if not parameter.requires_grad:
            assert parameter.dtype in (torch.int8, torch.float8_e4m3fn, torch.float32)
            continue
        diff = (parameter.grad - stock[name].grad).abs().max().item()
        assert diff <= 1e-4 * max(1.0, stock[name].grad.abs().max().item()), (name, diff)
        checked += 1
    assert checked > 10
    for (_, m), pointers in zip(_experts(model), held, strict=True):  # still quantized, in place
        assert m.gate_up_proj.element_size() == 1
        assert (m.gate_up_proj.data_ptr(), m.down_proj.data_ptr()) == pointers
    kh.unkernelize(model)


@pytest.mark.parametrize(
    ("quantization", "tamper", "reason"),
    [
        ("w8a8", None, "w8a8 (int8 activations too)"),
        ("mxfp4", None, "gmm_quantized reads int8 per-channel and fp8"),
        ("int8", "scale_requires_grad", "requires a gradient; quantized weights are frozen"),
    ],
)
def test_training_kernelize_refuses_what_gmm_quantized_does_not_run(quantization, tamper, reason):
    model = _qwen3_128()
    kh.quantize_experts(model, quantization)
    model.set_experts_implementation("eager")
    if tamper:
        for _, m in _experts(model):
            m.gate_up_proj_scale.requires_grad_(True)
    report = kh.kernelize(model.train(), mode="training")
    experts = [e for e in report.entries if e.kind == "experts"]
    assert experts and not any(e.swapped for e in experts), report
    assert all(reason in str(e) for e in experts), report
    with pytest.raises(NotImplementedError, match="moe-gemm cannot run it"):
        moe.integrations.experts_forward(
            _experts(model)[0][1], torch.zeros(2, 128), torch.zeros(2, 2, dtype=torch.long),
            torch.ones(2, 2),
        )  # fmt: skip


def test_quantized_experts_split_over_a_mesh_axis_are_refused(monkeypatch):
    """moe_ep (torchax tensors holding sharded arrays) runs float weights only."""
    model = _qwen3_128()
    kh.quantize_experts(model, "int8")
    experts = _experts(model)[0][1]
    monkeypatch.setattr(moe.integrations, "expert_axis", lambda weight: "ep")
    with pytest.raises(NotImplementedError, match=r"over mesh axis 'ep'.*quantized weights"):
        moe.integrations.experts_forward(
            experts, torch.zeros(2, 128), torch.zeros(2, 2, dtype=torch.long), torch.ones(2, 2)
        )


@pytest.mark.slow
def test_quantized_training_model_compiles_without_graph_breaks():
    model, _ = _quantized_and_reference("fp8")
    kh.kernelize(model.train(), mode="training")
    ids = torch.randint(2, 128, (2, 9), generator=torch.Generator().manual_seed(4))
    explanation = torch._dynamo.explain(model)(ids, use_cache=False)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    got = compiled(ids, labels=ids, use_cache=False)
    got.loss.backward()
    # with labels the fused causal-LM loss gives no logits: the compiled loss must be the eager one
    expected = model(ids, labels=ids, use_cache=False).loss
    assert (got.loss - expected).abs().item() <= 1e-5 * expected.abs().item()
    torch._dynamo.reset()
    kh.unkernelize(model)
