"""Quantized expert weights on Transformers experts modules (torch side).

Two sources:

* fp8 checkpoints loaded by Transformers (``FineGrainedFP8``): ``FP8Experts`` holds
  ``gate_up_proj`` / ``down_proj`` as float8_e4m3fn [E, out, in] with f32
  ``*_scale_inv`` [E, ceil(out/128), ceil(in/128)] (128 x 128 blocks, dynamic activations);
* ``quantize_experts(model, "int8" | "fp8" | "mxfp4")``: kernel-hub's explicit opt-in for
  bf16/f32 checkpoints. int8 stores ``*_scale`` [E, out] (per output channel); fp8 stores
  Transformers' ``*_scale_inv`` layout; mxfp4 stores GPT-OSS's checkpoint layout (the packed
  ``*_blocks`` bytes as ``gate_up_proj`` / ``down_proj`` [E, out, in / 2] uint8, e8m0
  ``*_scales`` [E, out, in / 32] uint8), also for GPT-OSS's [E, in, out] float weights. It
  returns the quantization error of every weight against the weight it replaced.

The quantized tensors stay on the module; the kernel reads them as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_BLOCK = 128
MX_GROUP = 32
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""Magnitudes of the e2m1 codes 0..7 (codes 8..15: the same, negative)."""
_PROJECTIONS = ("gate_up_proj", "down_proj")
_DTYPES = {torch.float8_e4m3fn: "fp8", torch.int8: "int8", torch.uint8: "mxfp4"}
KINDS = (*_DTYPES.values(), "w8a8")
W8A8_FLAG = "kernel_hub_w8a8"
"""Set on modules ``quantize_experts(model, "w8a8")`` made: int8 weights, int8 activations."""


def kind(module: torch.nn.Module) -> str | None:
    """ "fp8", "int8", "mxfp4", "w8a8" or None (float weights)."""
    found = _DTYPES.get(module.gate_up_proj.dtype)
    return "w8a8" if found == "int8" and getattr(module, W8A8_FLAG, False) else found


def _weight_format(quantization: str) -> str:
    return "int8" if quantization == "w8a8" else quantization


def scale_name(quantization: str, projection: str) -> str:
    suffix = {"fp8": "_scale_inv", "int8": "_scale", "mxfp4": "_scales"}
    return projection + suffix[_weight_format(quantization)]


def problem(module: torch.nn.Module) -> str | None:
    """Why the kernel cannot read the module's (quantized) weights, or None."""
    quantization = kind(module)
    if quantization is None:
        if not module.gate_up_proj.is_floating_point():
            return f"its expert weights are {module.gate_up_proj.dtype}"
        return None
    if getattr(module, "is_transposed", False):
        return "quantized [E, in, out] expert weights are not supported"
    if quantization == "mxfp4":
        for projection in _PROJECTIONS:
            scale = getattr(module, scale_name("mxfp4", projection), None)
            weight = getattr(module, projection)
            if scale is None or scale.dtype != torch.uint8:
                return f"its uint8 {projection} carries no uint8 {projection}_scales (mxfp4)"
            if tuple(scale.shape) != (*weight.shape[:2], 2 * weight.shape[2] // MX_GROUP):
                return f"{projection}_scales {tuple(scale.shape)} do not match {projection}"
        return None
    if quantization == "w8a8" and any(
        d % 128 for d in (*module.gate_up_proj.shape[1:], module.down_proj.shape[2])
    ):
        return "w8a8 quantizes activations per 128 columns; H and I must be multiples of 128"
    if quantization in ("int8", "w8a8") and not hasattr(module, "gate_up_proj_scale"):
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
            scale = getattr(module, scale_name("fp8", projection))
            if scale.dtype != torch.float32:
                return f"{projection} scales are {scale.dtype}; fused-moe reads float32 scales"
    return None


def expert_tensors(module: torch.nn.Module) -> tuple:
    """(w_gate_up, w_down, gate_up_bias, down_bias, gate_up_scale, down_scale) of the module."""
    has_bias = getattr(module, "has_bias", False)
    quantization = kind(module)
    scales = (
        tuple(getattr(module, scale_name(quantization, p)) for p in _PROJECTIONS)
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


def _quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """OCP MX: each group of 32 shares the power of two that puts its largest magnitude in
    [4, 8) (e2m1's top binade); values round to the nearest e2m1 value, saturating at 6."""
    experts, out, inner = w.shape
    if inner % MX_GROUP:
        raise ValueError(f"mxfp4 needs whole groups of {MX_GROUP}; weight is {tuple(w.shape)}")
    groups = w.view(experts, out, inner // MX_GROUP, MX_GROUP)
    amax = groups.abs().amax(dim=3)
    exponent = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2, torch.zeros_like(amax))
    biased = torch.clamp(exponent + 127, 0, 254)
    scaled = groups / torch.ldexp(torch.ones_like(amax), biased - 127)[..., None]
    grid = torch.tensor(FP4_VALUES)
    code = (scaled.abs()[..., None] - grid).abs().argmin(dim=-1)
    code = (code + 8 * (scaled < 0)).to(torch.uint8).view(experts, out, inner)
    return code[..., 0::2] | (code[..., 1::2] << 4), biased.to(torch.uint8)


def quantize_weight(weight: torch.Tensor, quantization: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(quantized [E, out, in] (mxfp4: [E, out, in / 2] bytes), scale) of a float weight;
    round to nearest."""
    w = weight.detach().to(torch.float32)
    quantization = _weight_format(quantization)
    if quantization == "mxfp4":
        return _quantize_mxfp4(w)
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
    quantization = _weight_format(quantization)
    if quantization == "mxfp4":
        grid = torch.tensor(FP4_VALUES + tuple(-v for v in FP4_VALUES))
        values = torch.stack([grid[(q & 15).long()], grid[(q >> 4).long()]], dim=-1).flatten(2)
        factor = torch.ldexp(torch.ones(scale.shape), scale.long() - 127)
        factor = factor.repeat_interleave(MX_GROUP, 2)
        return values * factor
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
    """Replace the module's float expert weights by quantized ones plus scales, in place (mxfp4
    turns GPT-OSS's [E, in, out] into the checkpoint's [E, out, in] layout)."""
    errors = []
    transposed = getattr(module, "is_transposed", False)
    for projection in _PROJECTIONS:
        weight = getattr(module, projection)
        if transposed:
            weight = weight.detach().transpose(1, 2)
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
            scale_name(quantization, projection), torch.nn.Parameter(scale, requires_grad=False)
        )
    if quantization == "fp8":
        module.block_size = (FP8_BLOCK, FP8_BLOCK)
    module.is_transposed = False
    setattr(module, W8A8_FLAG, quantization == "w8a8")
    return errors


def quantize_problem(module: torch.nn.Module, quantization: str) -> str | None:
    """Why ``quantize_experts`` leaves an experts module alone, or None."""
    if kind(module) is not None:
        return "its expert weights are already quantized"
    if quantization == "mxfp4":
        return None
    if getattr(module, "is_transposed", False):
        return "its weights are [E, in, out] (GPT-OSS layout); quantized weights use [E, out, in]"
    if getattr(module, "has_bias", False):
        return "it has expert biases"
    return None
