"""Layers whose ``forward`` replaces a LayerNorm's forward (state read from the host module).

Both read ``normalized_shape``, ``weight`` (or None), ``bias`` (or None) and ``eps`` from the host,
as ``torch.nn.LayerNorm`` holds them; a multi-dimensional ``normalized_shape`` is flattened into
one hidden axis (the same statistics). They differ only in the forward's parameter name, which
kernelize compares with the host's.
"""

from __future__ import annotations

import math

import torch

from kernel_hub.kernel_api import FLOATS_AND_F64, dtype_name

from .api import layer_norm, layer_norm_no_affine, layer_norm_no_bias


def layer_norm_any(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float = 1e-5,
    implementation: str | None = None,
) -> torch.Tensor:
    """The torch op for whichever of weight and bias are given (a bias alone gets a unit
    weight)."""
    if bias is not None:
        if weight is None:
            weight = torch.ones_like(bias)
        return layer_norm.torch(x, weight, bias, eps, implementation)
    if weight is not None:
        return layer_norm_no_bias.torch(x, weight, eps, implementation)
    return layer_norm_no_affine.torch(x, eps, implementation)


def _flat(param: torch.Tensor | None) -> torch.Tensor | None:
    return None if param is None else param.reshape(-1)


def _layer_norm(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    dims = len(module.normalized_shape)
    lead = x.shape[: x.dim() - dims]
    if x.device.type != "cpu" and torch.is_autocast_enabled(x.device.type):
        # CUDA's and XLA's autocast run layer_norm in f32 (CPU's leaves it alone); custom ops are
        # not cast by autocast, so the layer does what the stock op would get.
        x = x.float()
    y = layer_norm_any(
        x.reshape(*lead, -1), _flat(module.weight), _flat(module.bias), float(module.eps)
    )
    return y.reshape(x.shape)


class LayerNorm(torch.nn.Module):
    """Replaces ``torch.nn.LayerNorm.forward`` (BERT, RoBERTa, ViT, CLIP, Whisper, ModernBERT's
    ``bias=False``, Flux's ``elementwise_affine=False``). Output in the input's dtype."""

    can_torch_compile = True
    has_backward = True

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return _layer_norm(self, input)


class FP32LayerNorm(torch.nn.Module):
    """Replaces Diffusers' ``FP32LayerNorm.forward`` (Wan, ...): layer_norm of the input, weight
    and bias upcast to f32, cast back to the input's dtype, which is what the kernel computes."""

    can_torch_compile = True
    has_backward = True

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        origin_dtype = inputs.dtype
        return _layer_norm(self, inputs).to(origin_dtype)


def _layernorm_module_problem(module: torch.nn.Module) -> str | None:
    """Why the layers cannot run on ``module``'s state, or None (used by kernelize)."""
    shape = getattr(module, "normalized_shape", None)
    if not isinstance(shape, tuple) or not shape or not all(isinstance(n, int) for n in shape):
        return f"normalized_shape is {shape!r}; a non-empty tuple of ints is needed"
    for name in ("weight", "bias"):
        param = getattr(module, name, None)
        if param is None:
            continue
        if not isinstance(param, torch.Tensor):
            return f"{name} is {type(param).__name__}, not a tensor or None"
        if tuple(param.shape) != shape:
            return f"{name} has shape {tuple(param.shape)}, normalized_shape is {shape}"
        dtype = dtype_name(param.dtype)
        if dtype not in FLOATS_AND_F64:
            return f"{name} has dtype {dtype}; supported: {', '.join(FLOATS_AND_F64)}"
        if param.device.type == "meta":
            return f"{name} is on the meta device (not loaded)"
    eps = getattr(module, "eps", None)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps):
        return f"eps is {eps!r}, not a finite number"
    return None


MODULE_CHECKS = {"LayerNorm": _layernorm_module_problem, "FP32LayerNorm": _layernorm_module_problem}
"""Layer name -> check of the host module's state; kernelize leaves modules that fail alone."""
