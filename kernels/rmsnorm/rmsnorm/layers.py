"""Layers whose ``forward`` replaces a Transformers norm's forward (state read from the host).

One layer per RMSNorm form the model families use, each with that family's exact rounding
(``x̂`` = x normalised in f32):

* ``RMSNorm``: ``weight * x̂.to(x.dtype)`` (Llama, Mistral, Mixtral, Qwen2/3, DeepSeek, ...);
* ``RMSNormF32Scale``: ``(weight * x̂).to(x.dtype)``, the product in f32 (GPT-OSS, OLMo2);
* ``RMSNormZeroCentered``: ``(x̂ * (1 + weight)).to(x.dtype)`` in f32 (Gemma 1/2/3);
* ``RMSNormOfX``: ``RMSNorm`` for a forward that names its input ``x`` (Llama 4);
* ``RMSNormOptionalScale``: ``RMSNormF32Scale``, or ``x̂.to(x.dtype)`` with no weight when the
  module's ``with_scale`` is False (Gemma 4).

Each reads ``weight`` and ``variance_epsilon`` (or ``eps``) from the module it is swapped into;
``MODULE_CHECKS`` leaves alone a module holding any other tensor state (a bias, a buffer, a
submodule), since these forwards would ignore it.
"""

from __future__ import annotations

import torch

from kernel_hub.kernel_api import FLOATS_AND_F64, dtype_name

from . import api

rms_norm = api.rms_norm.torch
gated_rms_norm = api.gated_rms_norm.torch


def _epsilon(module: torch.nn.Module) -> float:
    eps = getattr(module, "variance_epsilon", None)
    return float(getattr(module, "eps", 1e-6) if eps is None else eps)


class RMSNorm(torch.nn.Module):
    """Llama's ``weight * x̂.to(x.dtype)``: result in the promoted dtype of x and weight."""

    can_torch_compile = True
    has_backward = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, self.weight, _epsilon(self), rounding="normalized")


class RMSNormF32Scale(torch.nn.Module):
    """GPT-OSS's and OLMo2's ``(weight * x̂).to(x.dtype)``: result in x's dtype."""

    can_torch_compile = True
    has_backward = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, self.weight, _epsilon(self), rounding="input")


class RMSNormZeroCentered(torch.nn.Module):
    """Gemma's ``(x̂ * (1 + weight.float())).type_as(x)``: the weight is stored around zero."""

    can_torch_compile = True
    has_backward = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, _epsilon(self), weight_offset=1.0, rounding="input")


class RMSNormOfX(torch.nn.Module):
    """Llama's form under the parameter name Llama 4's norms use (a swapped forward must take
    every call the stock one takes, keywords included)."""

    can_torch_compile = True
    has_backward = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, _epsilon(self), rounding="normalized")


class RMSNormOptionalScale(torch.nn.Module):
    """Gemma 4's ``(weight * x̂).to(x.dtype)``; with ``with_scale`` False the module holds no
    weight and the result is ``x̂.to(x.dtype)`` (a unit weight in x's dtype: exact)."""

    can_torch_compile = True
    has_backward = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        unit = None if self.with_scale else hidden_states.new_ones(hidden_states.shape[-1])
        weight = self.weight if unit is None else unit
        return rms_norm(hidden_states, weight, _epsilon(self), rounding="input")


def _rmsnorm_module_problem(module: torch.nn.Module) -> str | None:
    """Why these forwards cannot run on ``module``'s state, or None (used by kernelize)."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor):
        return "the module has no weight tensor"
    unread = [f"{name} (parameter)" for name, _ in module.named_parameters(recurse=False)]
    unread += [f"{name} (buffer)" for name, _ in module.named_buffers(recurse=False)]
    unread += [f"{name} (submodule)" for name, _ in module.named_children()]
    unread = [item for item in unread if item != "weight (parameter)"]
    if unread:
        return f"it holds state the layer does not read: {', '.join(unread)}"
    if weight.dim() != 1:
        return f"weight has shape {tuple(weight.shape)}; a 1-D weight is needed"
    dtype = dtype_name(weight.dtype)
    if dtype not in FLOATS_AND_F64:
        return f"weight has dtype {dtype}; supported: {', '.join(FLOATS_AND_F64)}"
    if weight.device.type == "meta":
        return "weight is on the meta device (not loaded)"
    return _epsilon_problem(module)


def _epsilon_problem(module: torch.nn.Module) -> str | None:
    epsilons = {n: getattr(module, n) for n in ("variance_epsilon", "eps") if hasattr(module, n)}
    for name, eps in epsilons.items():
        if isinstance(eps, bool) or not isinstance(eps, (int, float)):
            return f"{name} is {eps!r}, not a number"
    if len(set(epsilons.values())) > 1:
        return f"variance_epsilon and eps differ ({epsilons}); which one it uses is ambiguous"
    return None


def _optional_scale_problem(module: torch.nn.Module) -> str | None:
    with_scale = getattr(module, "with_scale", None)
    if not isinstance(with_scale, bool):
        return f"with_scale is {with_scale!r}, not True or False"
    if with_scale:
        return _rmsnorm_module_problem(module)
    state = [n for n, _ in module.named_parameters(recurse=False)]
    state += [n for n, _ in module.named_buffers(recurse=False)]
    state += [n for n, _ in module.named_children()]
    if state or getattr(module, "weight", None) is not None:
        held = ", ".join(state) or "weight"
        return f"with_scale is False but it holds state the layer does not read: {held}"
    return _epsilon_problem(module)


MODULE_CHECKS = dict.fromkeys(
    ("RMSNorm", "RMSNormF32Scale", "RMSNormZeroCentered", "RMSNormOfX"), _rmsnorm_module_problem
)
MODULE_CHECKS["RMSNormOptionalScale"] = _optional_scale_problem
"""Layer name -> check of the host module's state; kernelize leaves modules that fail alone."""


# torch.nn.RMSNorm and Diffusers' RMSNorm (the q/k norms of Flux, Wan, SD3, ...): same op, their
# own forward parameter names, an optional weight and a multi-dimensional normalized shape.

_HALF = (torch.float16, torch.bfloat16)


def _rms_norm_over(
    x: torch.Tensor, dims: int, weight: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """RMSNorm over the last ``dims`` dims of ``x`` (flattened into one axis); a missing weight
    is a unit weight in ``x``'s dtype (exact: the result keeps ``x``'s dtype)."""
    flat = x.reshape(*x.shape[: x.dim() - dims], -1)
    weight = flat.new_ones(flat.shape[-1]) if weight is None else weight.reshape(-1)
    return rms_norm(flat, weight, float(eps)).reshape(x.shape)


class TorchRMSNorm(torch.nn.Module):
    """Replaces ``torch.nn.RMSNorm.forward`` (Flux's per-head and Wan's across-head q/k norms):
    ``eps=None`` is the input dtype's machine epsilon, and the output has the input's dtype, as
    ``F.rms_norm``."""

    can_torch_compile = True
    has_backward = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
        return _rms_norm_over(x, len(self.normalized_shape), self.weight, eps).to(x.dtype)


class DiffusersRMSNorm(torch.nn.Module):
    """Replaces Diffusers' ``RMSNorm.forward`` (SD3, Sana, ...) without a bias. Output dtype as
    Diffusers': the weight's if it is half precision, else the promoted one; the input's without a
    weight. (Diffusers rounds x / rms to a half weight's dtype before scaling; the kernel rounds
    once, which differs by at most half-precision rounding.)"""

    can_torch_compile = True
    has_backward = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        y = _rms_norm_over(hidden_states, len(self.dim), self.weight, self.eps)
        if self.weight is not None and self.weight.dtype in _HALF:
            return y.to(self.weight.dtype)
        return y


def _weight_problem(weight: object, shape: tuple[int, ...]) -> str | None:
    if weight is None:
        return None
    if not isinstance(weight, torch.Tensor):
        return f"weight is {type(weight).__name__}, not a tensor or None"
    if tuple(weight.shape) != shape:
        return f"weight has shape {tuple(weight.shape)}, the normalized shape is {shape}"
    dtype = dtype_name(weight.dtype)
    if dtype not in FLOATS_AND_F64:
        return f"weight has dtype {dtype}; supported: {', '.join(FLOATS_AND_F64)}"
    if weight.device.type == "meta":
        return "weight is on the meta device (not loaded)"
    return None


def _eps_problem(eps: object, *, none_ok: bool) -> str | None:
    if eps is None and none_ok:
        return None
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        return f"eps is {eps!r}, not a number"
    return None


def _shape(value: object) -> tuple[int, ...] | None:
    if isinstance(value, tuple) and value and all(isinstance(n, int) for n in value):
        return tuple(value)
    return None


def _torch_rmsnorm_problem(module: torch.nn.Module) -> str | None:
    shape = _shape(getattr(module, "normalized_shape", None))
    if shape is None:
        return f"normalized_shape is {getattr(module, 'normalized_shape', None)!r}"
    return _weight_problem(getattr(module, "weight", None), shape) or _eps_problem(
        getattr(module, "eps", None), none_ok=True
    )


def _diffusers_rmsnorm_problem(module: torch.nn.Module) -> str | None:
    if getattr(module, "bias", None) is not None:
        return "it has a bias (RMSNorm(bias=True)), which the kernel does not add"
    shape = _shape(getattr(module, "dim", None))
    if shape is None:
        return f"dim is {getattr(module, 'dim', None)!r}"
    return _weight_problem(getattr(module, "weight", None), shape) or _eps_problem(
        getattr(module, "eps", None), none_ok=False
    )


MODULE_CHECKS |= {
    "TorchRMSNorm": _torch_rmsnorm_problem,
    "DiffusersRMSNorm": _diffusers_rmsnorm_problem,
}


# Gated norms of the hybrid models (Transformers' ``*RMSNormGated``): norm then ``* silu(gate)``
# (Qwen3-Next, Qwen3.5, Kimi-Linear, ...), or gate then a grouped norm (Bamba, Mamba-2, ...).


class RMSNormGated(torch.nn.Module):
    """Qwen3-Next's ``((weight * x̂.to(x.dtype)) * silu(gate.float())).to(x.dtype)``."""

    can_torch_compile = True
    has_backward = True

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(hidden_states, gate, self.weight, _epsilon(self), True, None)


class RMSNormGatedGrouped(torch.nn.Module):
    """Bamba's and Mamba-2's ``weight * norm(x.float() * silu(gate.float())).to(x.dtype)``, the
    norm taken per group of ``group_size`` channels; without a gate a grouped RMSNorm."""

    can_torch_compile = True
    has_backward = True

    def forward(
        self, hidden_states: torch.Tensor, gate: torch.Tensor | None = None
    ) -> torch.Tensor:
        return gated_rms_norm(
            hidden_states, gate, self.weight, _epsilon(self), False, int(self.group_size)
        )


def _gated_problem(module: torch.nn.Module) -> str | None:
    activation = getattr(module, "activation", "silu")
    if activation not in ("silu", "swish"):
        return f"activation is {activation!r}; the kernel gates with silu"
    return _rmsnorm_module_problem(module)


def _grouped_problem(module: torch.nn.Module) -> str | None:
    problem = _gated_problem(module)
    if problem is not None:
        return problem
    group = getattr(module, "group_size", None)
    hidden = module.weight.shape[0]
    if isinstance(group, bool) or not isinstance(group, int) or group <= 0 or hidden % group:
        return f"group_size is {group!r}; it must be an int dividing the hidden size {hidden}"
    return None


MODULE_CHECKS |= {"RMSNormGated": _gated_problem, "RMSNormGatedGrouped": _grouped_problem}
