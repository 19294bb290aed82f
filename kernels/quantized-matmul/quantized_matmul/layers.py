"""The ``QuantizedLinear`` layer: its ``forward`` replaces kernel-hub's ``QuantizedLinear``
(``kernel_hub.quantize_linear``, fine-grained FP8 checkpoints loaded by
``kernel_hub.from_pretrained``: fine-grained FP8 and GPTQ int4), reading the host's quantized
``weight`` and its scale (``weight_scale_inv`` for fp8 blocks, ``weight_scale`` for int8
channels and int4 groups) in place; an int32 weight (GPTQ-packed int4) goes to
``quantized_matmul_int4`` with the host's ``weight_zeros`` (per-group zero points, when it holds
them), its activation columns first taken in the host's ``input_order`` when it holds one
(act-order checkpoints: an exact gather); a host whose ``format`` is "w8a8" also has its
activations quantized per token (``activations="int8"``).

The product is kept in f32 until the bias is added, then rounded once to the activation dtype,
as ``F.linear`` of the dequantized weight rounds.
"""

from __future__ import annotations

import torch

from kernel_hub.kernel_api import dtype_name

from . import api
from .api import ACTIVATION_DTYPES, FORMATS, scale_shape, weight_dims

quantized_matmul = api.quantized_matmul.torch
quantized_matmul_int4 = api.quantized_matmul_int4.torch

SCALE_NAMES = ("weight_scale_inv", "weight_scale")


def _scale(module: torch.nn.Module) -> torch.Tensor | None:
    for name in SCALE_NAMES:
        scale = getattr(module, name, None)
        if isinstance(scale, torch.Tensor):
            return scale
    return None


class QuantizedLinear(torch.nn.Module):
    """``input @ (weight * scale)^T + bias`` with the weight read quantized."""

    can_torch_compile = True
    has_backward = True  # the activations' gradient; the weight is frozen (w8a8: refused)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.weight.dtype == torch.int32:
            order = getattr(self, "input_order", None)
            if order is not None:
                input = input.index_select(-1, order)
            zeros = getattr(self, "weight_zeros", None)
            out = quantized_matmul_int4(
                input, self.weight, _scale(self), torch.float32, None, zeros
            )
        else:
            activations = "int8" if getattr(self, "format", None) == "w8a8" else None
            out = quantized_matmul(
                input, self.weight, _scale(self), torch.float32, None, activations
            )
        if self.bias is not None:
            out = out + self.bias.float()
        return out.to(input.dtype)


def _problem(module: torch.nn.Module) -> str | None:
    """Why ``QuantizedLinear.forward`` cannot take ``module``'s state, or None."""
    weight, scale = getattr(module, "weight", None), _scale(module)
    if not isinstance(weight, torch.Tensor) or weight.ndim != 2:
        return "it has no 2-D weight"
    if dtype_name(weight.dtype) not in FORMATS:
        return f"its weight is {dtype_name(weight.dtype)}; valid: {', '.join(FORMATS)}"
    if scale is None:
        return f"it has none of the scales {', '.join(SCALE_NAMES)}"
    if weight.dtype == torch.int32 and weight.shape[0] * 8 % 128:
        return f"its int4 weight {tuple(weight.shape)} holds no whole groups of 128 inputs"
    expected = scale_shape(FORMATS[dtype_name(weight.dtype)], *weight_dims(weight))
    if tuple(scale.shape) != expected or scale.dtype != torch.float32:
        return f"its scale is {scale.dtype} {tuple(scale.shape)}; it needs float32 {expected}"
    if (problem := _int4_extras_problem(module, weight, expected)) is not None:
        return problem
    if weight.device.type == "meta":
        return "its weight is on the meta device"
    bias = getattr(module, "bias", None)
    if bias is not None and dtype_name(bias.dtype) not in ACTIVATION_DTYPES:
        return f"its bias is {dtype_name(bias.dtype)}"
    return None


def _int4_extras_problem(module: torch.nn.Module, weight: torch.Tensor, scale_shape) -> str | None:
    """Why the host's int4 zero points or input order cannot be read, or None."""
    zeros, order = getattr(module, "weight_zeros", None), getattr(module, "input_order", None)
    if weight.dtype != torch.int32:
        if zeros is not None or order is not None:
            return "it holds int4 zero points or an input order but its weight is not int4"
        return None
    if zeros is not None and (zeros.dtype != torch.int32 or tuple(zeros.shape) != scale_shape):
        return (
            f"its weight_zeros is {zeros.dtype} {tuple(zeros.shape)}; it needs int32 {scale_shape}"
        )
    inner = weight.shape[0] * 8
    if order is not None and (order.dtype != torch.int64 or tuple(order.shape) != (inner,)):
        return f"its input_order is {order.dtype} {tuple(order.shape)}; it needs int64 ({inner},)"
    return None


MODULE_CHECKS = {"QuantizedLinear": _problem}
