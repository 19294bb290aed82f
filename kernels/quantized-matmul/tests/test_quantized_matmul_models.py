"""Quantized linear layers in a model: a tiny Llama saved by hand as a fine-grained FP8
checkpoint loads on this CPU with its weights still float8_e4m3fn, kernelize swaps every
projection for the quantized-matmul layer, and logits and greedy tokens match the stock Llama
holding the dequantized weights; ``quantize_linear`` reports its measured error."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaForCausalLM

import kernel_hub
from kernel_hub.errors import KernelHubError
from kernel_hub.models.tiny import tiny_model

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The shared tiny sizes but hidden 256 and intermediate 384: 2 and 3 fp8 blocks, k/v out 128
SIZES = dict(hidden_size=256, intermediate_size=384, tie_word_embeddings=False)


def fp8_by_hand(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's layout, written out here: e4m3 weight, one f32 scale per 128x128 block that
    multiplies (``weight_scale_inv``)."""
    out, inner = weight.shape
    scale = torch.empty(-(-out // 128), -(-inner // 128))
    q = torch.empty(out, inner, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            block = weight[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
            scale[i, j] = block.abs().max() / 448
            q[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] = (block / scale[i, j]).to(
                torch.float8_e4m3fn
            )
    return q, scale


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    """(path, stock Llama holding the dequantized weights)."""
    stock = tiny_model(LlamaForCausalLM, seed=0, **SIZES)
    tensors = {}
    for name, tensor in stock.state_dict().items():
        module = name.rsplit(".", 2)[-2] if name.endswith(".weight") else ""
        if module in PROJECTIONS:
            q, scale = fp8_by_hand(tensor)
            tensors[name], tensors[name.replace(".weight", ".weight_scale_inv")] = q, scale
            full = scale.double().repeat_interleave(128, 0).repeat_interleave(128, 1)
            dequantized = q.double() * full[: q.shape[0], : q.shape[1]]
            tensor.copy_(dequantized.float())  # the stock model's weight: what fp8 stands for
        else:
            tensors[name] = tensor.clone()
    path = tmp_path_factory.mktemp("llama-fp8")
    save_file(tensors, path / "model.safetensors")
    config = stock.config.to_dict()
    config["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    (path / "config.json").write_text(json.dumps(config))
    return path, stock


def test_fp8_checkpoint_kept_quantized_kernelized_and_exact(fp8_checkpoint):
    path, stock = fp8_checkpoint
    model = kernel_hub.from_pretrained(AutoModelForCausalLM, path, mode="inference")
    linears = {n: m for n, m in model.named_modules() if type(m).__name__ == "QuantizedLinear"}
    assert len(linears) == 2 * len(PROJECTIONS)
    assert all(m.weight.dtype == torch.float8_e4m3fn for m in linears.values())
    report = kernel_hub.kernelize_report(model)
    swapped = {e.module for e in report.entries if e.swapped_to and e.op == "quantized-matmul"}
    assert swapped == set(linears), report
    ids = torch.tensor([[1, 5, 9, 33, 2, 77, 100, 3]])
    with torch.no_grad(), torch.profiler.profile() as profile:
        got = model(ids).logits
    calls = [e for e in profile.events() if e.name.endswith("::quantized_matmul")]
    assert len(calls) == len(linears)  # the op ran for every projection
    with torch.no_grad():
        want = stock(ids).logits
    rel = float((got - want).abs().max() / want.abs().max())
    assert rel <= 1e-5, rel
    kwargs = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(model.generate(ids, **kwargs), stock.generate(ids, **kwargs))


def test_other_quantization_methods_are_refused_with_the_reason(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"quantization_config": {"quant_method": "gptq"}})
    )
    with pytest.raises(KernelHubError, match="quant_method='gptq'; kernel-hub loads 'fp8'"):
        kernel_hub.from_pretrained(AutoModelForCausalLM, tmp_path)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_quantize_linear_reports_its_error_and_kernelize_is_exact_against_it(fmt):
    model = tiny_model(LlamaForCausalLM, seed=1, **SIZES)
    report = kernel_hub.quantize_linear(model, fmt)
    assert len(report.layers) == 2 * len(PROJECTIONS)
    assert report.left_alone == (("lm_head", "skipped (skip=)"),)
    bound = 1 / 254 if fmt == "int8" else 1 / 16  # half a step of 127 levels; e4m3's 3 bits
    assert all(0 < layer.max_rel_error <= bound for layer in report.layers)
    assert all(layer.bytes_after < layer.bytes_before / 3 for layer in report.layers)
    ids = torch.tensor([[4, 8, 15, 16, 23, 42]])
    with torch.no_grad():
        want = model(ids).logits  # QuantizedLinear's own forward: the dequantized weight
        kernel_hub.kernelize(model, mode="inference")
        got = model(ids).logits
    swapped = [e for e in kernel_hub.kernelize_report(model).entries if e.op == "quantized-matmul"]
    assert len(swapped) == 2 * len(PROJECTIONS) and all(e.swapped_to for e in swapped)
    assert float((got - want).abs().max() / want.abs().max()) <= 1e-5
