"""Quantized experts in tiny models: fp8 experts in Transformers' FineGrainedFP8 layout
(``FP8Experts``, 128x128 block scales) and kernel-hub's opt-in ``quantize_experts``. Kernelized
logits equal Transformers' dequantize-then-matmul path, and the quantized tensors stay
quantized on the modules."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from moe_models import build, experts_modules  # noqa: E402
from transformers.integrations.finegrained_fp8 import (  # noqa: E402
    ALL_FP8_EXPERTS_FUNCTIONS,
    FP8Experts,
    _dequantize_fp8_weight,
)
from transformers.integrations.moe import use_experts_implementation  # noqa: E402

import kernel_hub as kh  # noqa: E402
from kernel_hub import get_kernel  # noqa: E402
from kernel_hub.models.tiny import tiny_model  # noqa: E402

fused = get_kernel("fused-moe")
quantized = fused.KERNEL.integration("transformers").quantized
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


def _qwen3_128(dtype):
    """Tiny Qwen3-MoE with whole 128x128 blocks (hidden and expert width 128)."""
    from transformers import Qwen3MoeForCausalLM

    return tiny_model(Qwen3MoeForCausalLM, hidden_size=128, moe_intermediate_size=128,
                      num_experts=8, num_experts_per_tok=2, head_dim=32,
                      pad_token_id=0).to(dtype)  # fmt: skip


def _to_fp8_experts(model) -> None:
    """Replace each experts module by Transformers' FP8Experts holding the same weights
    quantized (what loading a FineGrainedFP8 checkpoint builds)."""
    cls = use_experts_implementation(experts_class=FP8Experts,
                                     experts_interface=ALL_FP8_EXPERTS_FUNCTIONS)  # fmt: skip
    for name, module in list(model.named_modules()):
        if not name.endswith(".experts"):
            continue
        fp8 = cls(model.config, block_size=(128, 128))
        for projection in ("gate_up_proj", "down_proj"):
            q, scale = quantized.quantize_weight(getattr(module, projection), "fp8")
            getattr(fp8, projection).data = q
            getattr(fp8, f"{projection}_scale_inv").data = scale
        model.set_submodule(name, fp8)
    model.set_experts_implementation("eager")


def _dequantized_reference(model, dtype):
    """The stock model with every FP8Experts replaced by float experts holding Transformers'
    own dequantization of its weights."""
    reference = _qwen3_128(dtype)
    reference.load_state_dict(
        {k: v for k, v in model.state_dict().items() if "experts" not in k}, strict=False
    )
    for name, module in model.named_modules():
        if isinstance(module, FP8Experts):
            target = reference.get_submodule(name)
            for projection in ("gate_up_proj", "down_proj"):
                w = _dequantize_fp8_weight(getattr(module, projection),
                                           getattr(module, f"{projection}_scale_inv"),
                                           [128, 128], dtype)  # fmt: skip
                getattr(target, projection).data = w
    return reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_checkpoint_layout_matches_transformers_dequantized_path(dtype):
    model = _qwen3_128(dtype)
    _to_fp8_experts(model)
    reference = _dequantized_reference(model, dtype)
    ids = torch.randint(2, 128, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = reference(ids).logits.float()
    experts = [m for m in model.modules() if isinstance(m, FP8Experts)]
    held = [(m.gate_up_proj.data_ptr(), m.down_proj.data_ptr()) for m in experts]
    report = kh.kernelize(model, mode="inference")
    swapped = [e for e in report.entries if e.kind == "experts"]
    assert swapped and all(e.swapped for e in swapped), report
    with torch.no_grad():
        got = model(ids).logits.float()
    diff = (got - expected).abs().max().item()
    assert diff <= TOLERANCE[dtype] * max(1.0, expected.abs().max().item()), diff
    for m, pointers in zip(experts, held, strict=True):  # bytes held: fp8, the same storage
        assert m.gate_up_proj.dtype == m.down_proj.dtype == torch.float8_e4m3fn
        assert (m.gate_up_proj.data_ptr(), m.down_proj.data_ptr()) == pointers
    kh.unkernelize(model)


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_quantize_experts_reports_its_error_and_runs_exactly(quantization):
    model = _qwen3_128(torch.float32)
    original = copy.deepcopy(model)
    ids = torch.randint(2, 128, (2, 7), generator=torch.Generator().manual_seed(3))
    report = kh.quantize_experts(model, quantization)
    assert len(report.errors) == 2 * len(experts_modules(model))
    for error in report.errors:  # reported, never zero, 8-bit sized
        assert 0 < error.relative_rms < 0.05, error
        assert error.bytes_after < error.bytes_before / 3
    for m in experts_modules(model):
        assert m.gate_up_proj.element_size() == 1 and not m.gate_up_proj.requires_grad
    # Exact against the same math on the dequantized weights (stock experts)
    dequantized = copy.deepcopy(original)
    for name, m in model.named_modules():
        if m in experts_modules(model):
            target = dequantized.get_submodule(name)
            for projection in ("gate_up_proj", "down_proj"):
                scale_name = projection + ("_scale_inv" if quantization == "fp8" else "_scale")
                w = quantized.dequantize_weight(getattr(m, projection), getattr(m, scale_name),
                                                quantization)  # fmt: skip
                getattr(target, projection).data = w
    with torch.no_grad():
        got = model(ids).logits
        exact = dequantized(ids).logits
        unquantized = original(ids).logits
    assert (got - exact).abs().max().item() <= 1e-4
    error = (got - unquantized).abs().max().item()
    print(f"{quantization}: max |logit error| vs the unquantized model {error:.3g}")
    assert error > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a8_reports_its_error_against_unquantized_and_int8_weights_only(dtype):
    """W8A8: the logit error against the unquantized model is measured and printed beside
    W8A16's (int8 weights only), so the activation quantization's share is visible (in bf16 both
    sit at bf16's rounding of these logits)."""
    ids = torch.randint(2, 128, (2, 7), generator=torch.Generator().manual_seed(5))
    errors = {}
    with torch.no_grad():
        reference = _qwen3_128(dtype)(ids).logits.float()
        for quantization in ("int8", "w8a8"):
            model = _qwen3_128(dtype)
            report = kh.quantize_experts(model, quantization)
            assert ("activations: int8" in str(report)) == (quantization == "w8a8")
            assert all(quantized.kind(m) == quantization for m in experts_modules(model))
            errors[quantization] = (model(ids).logits.float() - reference).abs().max().item()
    scale = reference.abs().max().item()
    print(f"{dtype}: max |logit error| vs unquantized (logits up to {scale:.3g}): {errors}")
    assert errors["int8"] > 0 and 0 < errors["w8a8"] < 0.1 * scale, errors


def test_quantize_experts_leaves_gpt_oss_alone_with_the_reason():
    model = build("gpt_oss")
    report = kh.quantize_experts(model, "int8")
    assert not report.errors
    assert report.left_alone and all("[E, in, out]" in why for _, why in report.left_alone)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpt_oss_mxfp4_matches_transformers_dequantized_path(dtype, implementation):
    """GPT-OSS's experts in MXFP4 (its checkpoint layout: packed ``*_blocks`` bytes and e8m0
    ``*_scales``) run by the fused kernel equal the stock model holding Transformers' own
    ``convert_moe_packed_tensors`` dequantization of the same bytes; the bytes stay held.

    bf16: each experts call is within one bf16 ulp of the XLA path, but over two layers and the
    other kernelized layers (attention, norms) rounding compounds: measured 0.010 (XLA) and 0.041
    (Pallas) against stock bf16 logits of max 0.62, hence 5e-2 here."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    model = build("gpt_oss", dtype)
    report = kh.quantize_experts(model, "mxfp4")
    experts = experts_modules(model)
    assert len(report.errors) == 2 * len(experts) and not report.left_alone
    for error in report.errors:  # 4-bit sized, and its error reported
        assert 0 < error.relative_rms < 0.2, error
        assert error.bytes_after < error.bytes_before / 3.5
    reference = build("gpt_oss", dtype)
    for name, m in model.named_modules():
        if m in experts:
            for projection in ("gate_up_proj", "down_proj"):
                scales = getattr(m, f"{projection}_scales")
                blocks = getattr(m, projection).view(*scales.shape, 16)
                w = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [E, in, out]
                getattr(reference.get_submodule(name), projection).data = w
    report = kh.kernelize(model, mode="inference")  # pads the bytes once (``padding``)
    swapped = [e for e in report.entries if e.kind == "experts"]
    assert swapped and all(e.swapped for e in swapped), report
    held = [(m.gate_up_proj.data_ptr(), m.down_proj.data_ptr()) for m in experts]
    impl, chosen, use = implementation
    use()
    ids = torch.randint(2, 128, (2, 7), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = reference(ids).logits.float()
        got = model(ids).logits.float()
    diff = (got - expected).abs().max().item()
    tolerance = 5e-2 if dtype == torch.bfloat16 else TOLERANCE[dtype]
    assert diff <= tolerance * max(1.0, expected.abs().max().item()), diff
    assert set(chosen) == {impl}, chosen
    for m, pointers in zip(experts, held, strict=True):
        assert m.gate_up_proj.dtype == m.down_proj.dtype == torch.uint8
        assert (m.gate_up_proj.data_ptr(), m.down_proj.data_ptr()) == pointers
    kh.unkernelize(model)


def test_unknown_quantization_is_refused():
    with pytest.raises(Exception, match="must be one of"):
        kh.quantize_experts(build("mixtral"), "int4")
