"""Tiny Mixtral, Qwen3-MoE, GPT-OSS and DeepSeek-V3 kernelized for inference: their experts run
on the fused kernel, logits match the stock model on a padded batch, greedy continuous batching
matches generate(); training mode keeps moe-gemm."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from moe_models import MODELS, build, experts_modules  # noqa: E402
from transformers import ContinuousBatchingConfig, GenerationConfig  # noqa: E402

import kernel_hub as kh  # noqa: E402
from kernel_hub import get_kernel  # noqa: E402
from kernel_hub.layers.integrations.continuous_batching import generate_batch  # noqa: E402
from kernel_hub.testing import greedy_continuations  # noqa: E402

fused = get_kernel("fused-moe")
TOLERANCE = 1e-4
PROMPTS = [[(7 * i + 3 * j) % 120 + 2 for j in range(n)] for i, n in enumerate([11, 3, 7])]
GREEDY = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=-1, pad_token_id=0)


def padded_batch():
    ids = torch.randint(2, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    ids[1, :4], mask[1, :4] = 0, 0  # left padding
    return ids, mask


def _experts_entries(report):
    return [e for e in report.entries if e.kind == "experts"]


@pytest.mark.parametrize("name", list(MODELS))
def test_kernelized_logits_match_stock(name, implementation):
    impl, chosen, use = implementation
    model = build(name)
    ids, mask = padded_batch()
    with torch.no_grad():
        expected = model(ids, attention_mask=mask).logits
    report = kh.kernelize(model, mode="inference")
    entries = _experts_entries(report)
    assert entries and all(e.swapped for e in entries), report
    assert all("fused-moe" in e.swapped_to for e in entries), report
    use()
    with torch.no_grad():
        got = model(ids, attention_mask=mask).logits
    assert chosen and set(chosen) == {impl}, chosen
    real = mask.bool()
    diff = (got - expected)[real].abs().max().item()
    assert diff <= TOLERANCE, f"{name}: logits differ from stock by {diff:.3g}"
    kh.unkernelize(model)


def test_training_mode_keeps_moe_gemm():
    model = build("mixtral").train()
    report = kh.kernelize(model, mode="training")
    entries = _experts_entries(report)
    assert entries and all("moe-gemm" in e.swapped_to for e in entries), report
    kh.unkernelize(model)


@pytest.mark.parametrize("name", ["mixtral", "gpt_oss"])
def test_gradients_through_the_fused_forward_match_stock(name):
    """A training step on a model kernelized for inference stays exact: the backward
    differentiates the XLA path."""
    ids, mask = padded_batch()
    model = build(name)
    kernelized = build(name)
    kh.kernelize(kernelized, mode="inference")
    for m in (model, kernelized):
        m.zero_grad()
        m(ids, attention_mask=mask, labels=ids).loss.backward()
    expected = dict(model.named_parameters())
    for pname, p in kernelized.named_parameters():
        if expected[pname].grad is None:
            continue
        diff = (p.grad - expected[pname].grad).abs().max().item()
        assert diff <= TOLERANCE, f"{name} grad of {pname} differs by {diff:.3g}"
    kh.unkernelize(kernelized)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_generate_batch_matches_generate(name, implementation):
    """Continuous batching (prefill chunks mixed with decode, T changing every step) runs the
    fused experts; DeepSeek-V3 is left out: stock generate_batch returns no tokens for MLA in
    Transformers 5.24."""
    _, chosen, use = implementation
    model = build(name)
    expected = greedy_continuations(model, PROMPTS, GREEDY)
    kh.kernelize(model, mode="inference")
    use()
    calls = []
    original = fused.integrations.fused_experts

    def counting(*args, **kwargs):
        calls.append(args[0].shape[0])
        return original(*args, **kwargs)

    fused.integrations.fused_experts = counting
    try:
        results = generate_batch(
            model,
            PROMPTS,
            generation_config=GREEDY,
            continuous_batching_config=ContinuousBatchingConfig(
                num_blocks=32, max_batch_tokens=16, page_size=16
            ),
        )
    finally:
        fused.integrations.fused_experts = original
    got = [results[f"req_{i}"].generated_tokens for i in range(len(PROMPTS))]
    assert got == expected
    assert set(chosen) == {implementation[0]}, chosen
    assert calls and all(rows & (rows - 1) == 0 for rows in calls), calls  # power-of-two buckets
    assert len(set(calls)) > 1
    kh.unkernelize(model)


def test_modules_have_the_form_they_were_read_as():
    """GPT-OSS's clamped gate is recognised as gpt_oss on interleaved [E, H, 2I] weights;
    Mixtral's as silu; a gate the kernel lacks is reported, not run."""
    integ = fused.integrations
    (gpt,) = experts_modules(build("gpt_oss"))[:1]
    assert integ.activation_of(gpt) == ("gpt_oss", "")
    mixtral = experts_modules(build("mixtral"))[0]
    assert integ.activation_of(mixtral) == ("silu", "")
    mixtral.act_fn = torch.nn.Tanh()
    kind, why = integ.activation_of(mixtral)
    assert kind is None and "matches none" in why


@pytest.mark.slow
@pytest.mark.parametrize("name,quantization", [("mixtral", None), ("gpt_oss", "mxfp4")])
def test_torch_compile_fullgraph_matches_eager(name, quantization):
    """kernelize(mode=inference | torch_compile) picks the fused experts (can_torch_compile), the
    model compiles with no graph break (fullgraph, aot_eager), and its logits equal eager's."""
    from kernel_hub.layers.modes import Mode

    model = build(name)
    if quantization:
        kh.quantize_experts(model, quantization)
    report = kh.kernelize(model, mode=Mode.INFERENCE | Mode.TORCH_COMPILE)
    entries = _experts_entries(report)
    assert entries and all("fused-moe" in e.swapped_to for e in entries), report
    ids = torch.randint(2, 128, (2, 7), generator=torch.Generator().manual_seed(6))
    explanation = torch._dynamo.explain(model)(ids, use_cache=False)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits
        got = compiled(ids, use_cache=False).logits
    torch._dynamo.reset()
    kh.unkernelize(model)
    assert (got - expected).abs().max().item() <= 1e-6
