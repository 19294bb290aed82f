"""Quantized expert weights on Transformers experts modules (torch side).

Two sources:

* fp8 checkpoints loaded by Transformers (``FineGrainedFP8``): ``FP8Experts`` holds
  ``gate_up_proj`` / ``down_proj`` as float8_e4m3fn [E, out, in] with f32
  ``*_scale_inv`` [E, ceil(out/128), ceil(in/128)] (128 x 128 blocks, dynamic activations);
* ``quantize_experts(model, "int8" | "fp8")``: kernel-hub's explicit opt-in for bf16/f32
  checkpoints. int8 stores ``*_scale`` [E, out] (per output channel); fp8 stores Transformers'
  ``*_scale_inv`` layout. It returns the quantization error of every weight against the weight it
  replaced.

The quantized tensors stay on the module; the kernel reads them as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_BLOCK = 128
_PROJECTIONS = ("gate_up_proj", "down_proj")


def kind(module: torch.nn.Module) -> str | None:
    """ "fp8", "int8" or None (float weights)."""
    dtype = module.gate_up_proj.dtype
    if dtype == torch.float8_e4m3fn:
        return "fp8"
    if dtype == torch.int8:
        return "int8"
    return None


def _scale_name(quantization: str, projection: str) -> str:
    return f"{projection}_scale_inv" if quantization == "fp8" else f"{projection}_scale"


def problem(module: torch.nn.Module) -> str | None:
    """Why the kernel cannot read the module's (quantized) weights, or None."""
    quantization = kind(module)
    if quantization is None:
        if not module.gate_up_proj.is_floating_point():
            return f"its expert weights are {module.gate_up_proj.dtype}"
        return None
    if getattr(module, "is_transposed", False):
        return "quantized [E, in, out] expert weights are not supported"
    if quantization == "int8" and not hasattr(module, "gate_up_proj_scale"):
        return (
            "its int8 expert weights carry no per-channel *_scale (FP4-packed or another "
            "format); fused-moe reads int8 made by kernel_hub.quantize_experts"
        )
    if quantization == "fp8":
        block = getattr(module, "block_size", None)
        if block is None or tuple(block) != (FP8_BLOCK, FP8_BLOCK):
            return f"fp8 weights with block_size {block}; fused-moe reads 128x128 blocks"
        if getattr(module, "activation_scheme", "dynamic") != "dynamic":
            return "fp8 with static activation scales (W8A8); fused-moe runs W8A16"
        for projection in _PROJECTIONS:
            weight = getattr(module, projection)
            if weight.shape[1] % FP8_BLOCK or weight.shape[2] % FP8_BLOCK:
                return f"{projection} {tuple(weight.shape)} is not whole 128x128 blocks"
            scale = getattr(module, _scale_name("fp8", projection))
            if scale.dtype != torch.float32:
                return f"{projection} scales are {scale.dtype}; fused-moe reads float32 scales"
    return None


def expert_tensors(module: torch.nn.Module) -> tuple:
    """(w_gate_up, w_down, gate_up_bias, down_bias, gate_up_scale, down_scale) of the module."""
    has_bias = getattr(module, "has_bias", False)
    quantization = kind(module)
    scales = (
        tuple(getattr(module, _scale_name(quantization, p)) for p in _PROJECTIONS)
        if quantization
        else (None, None)
    )
    return (
        module.gate_up_proj,
        module.down_proj,
        module.gate_up_proj_bias if has_bias else None,
        module.down_proj_bias if has_bias else None,
        *scales,
    )


def quantize_weight(weight: torch.Tensor, quantization: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(quantized [E, out, in], f32 scale) of a float weight; round to nearest."""
    w = weight.detach().to(torch.float32)
    if quantization == "int8":
        amax = w.abs().amax(dim=2)
        scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
        q = torch.clamp(torch.round(w / scale[:, :, None]), -127, 127).to(torch.int8)
        return q, scale
    experts, out, inner = w.shape
    if out % FP8_BLOCK or inner % FP8_BLOCK:
        raise ValueError(f"fp8 needs whole 128x128 blocks; weight is {tuple(w.shape)}")
    tiles = w.view(experts, out // FP8_BLOCK, FP8_BLOCK, inner // FP8_BLOCK, FP8_BLOCK)
    amax = tiles.abs().amax(dim=(2, 4))
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    q = (tiles / scale[:, :, None, :, None]).view_as(w).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor, quantization: str) -> torch.Tensor:
    """The f32 weight a quantized one stands for."""
    w = q.to(torch.float32)
    if quantization == "int8":
        return w * scale[:, :, None]
    full = scale.repeat_interleave(FP8_BLOCK, 1).repeat_interleave(FP8_BLOCK, 2)
    return w * full[:, : w.shape[1], : w.shape[2]]


@dataclass(frozen=True)
class WeightError:
    """How far a quantized weight is from the weight it replaced."""

    module: str
    projection: str
    quantization: str
    bytes_before: int
    bytes_after: int
    relative_rms: float
    """||W - dequantize(Q)|| / ||W||."""
    max_abs: float


def quantize_module(name: str, module: torch.nn.Module, quantization: str) -> list[WeightError]:
    """Replace the module's float expert weights by quantized ones plus scales, in place."""
    errors = []
    for projection in _PROJECTIONS:
        weight = getattr(module, projection)
        q, scale = quantize_weight(weight, quantization)
        diff = dequantize_weight(q, scale, quantization) - weight.detach().float()
        errors.append(
            WeightError(
                name,
                projection,
                quantization,
                weight.numel() * weight.element_size(),
                q.numel() * q.element_size() + scale.numel() * scale.element_size(),
                float(diff.norm() / weight.detach().float().norm().clamp_min(1e-30)),
                float(diff.abs().max()),
            )
        )
        setattr(module, projection, torch.nn.Parameter(q, requires_grad=False))
        module.register_parameter(
            _scale_name(quantization, projection), torch.nn.Parameter(scale, requires_grad=False)
        )
    if quantization == "fp8":
        module.block_size = (FP8_BLOCK, FP8_BLOCK)
    return errors


def quantize_problem(module: torch.nn.Module) -> str | None:
    """Why ``quantize_experts`` leaves an experts module alone, or None."""
    if kind(module) is not None:
        return "its expert weights are already quantized"
    if getattr(module, "is_transposed", False):
        return "its weights are [E, in, out] (GPT-OSS layout); quantized weights use [E, out, in]"
    if getattr(module, "has_bias", False):
        return "it has expert biases"
    return None
