"""Layers whose ``forward`` replaces a Transformers norm's forward (state read from the host).

One layer per RMSNorm form the model families use, each with that family's exact rounding
(``x̂`` = x normalised in f32):

* ``RMSNorm``: ``weight * x̂.to(x.dtype)`` (Llama, Mistral, Mixtral, Qwen2/3, DeepSeek, ...);
* ``RMSNormF32Scale``: ``(weight * x̂).to(x.dtype)``, the product in f32 (GPT-OSS, OLMo2);
* ``RMSNormZeroCentered``: ``(x̂ * (1 + weight)).to(x.dtype)`` in f32 (Gemma 1/2/3).

Each reads ``weight`` and ``variance_epsilon`` (or ``eps``) from the module it is swapped into;
``MODULE_CHECKS`` leaves alone a module holding any other tensor state (a bias, a buffer, a
submodule), since these forwards would ignore it.
"""

from __future__ import annotations

import torch

from kernel_hub.kernel_api import FLOATS_AND_F64, dtype_name

from .torch_ops import rms_norm


def _epsilon(module: torch.nn.Module) -> float:
    eps = getattr(module, "variance_epsilon", None)
    return float(getattr(module, "eps", 1e-6) if eps is None else eps)


class RMSNorm(torch.nn.Module):
    """Llama's ``weight * x̂.to(x.dtype)``: result in the promoted dtype of x and weight."""

    can_torch_compile = True
    has_backward = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, self.weight, _epsilon(self), None, 0.0, "normalized")


class RMSNormF32Scale(torch.nn.Module):
    """GPT-OSS's and OLMo2's ``(weight * x̂).to(x.dtype)``: result in x's dtype."""

    can_torch_compile = True
    has_backward = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, self.weight, _epsilon(self), None, 0.0, "input")


class RMSNormZeroCentered(torch.nn.Module):
    """Gemma's ``(x̂ * (1 + weight.float())).type_as(x)``: the weight is stored around zero."""

    can_torch_compile = True
    has_backward = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, _epsilon(self), None, 1.0, "input")


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
    epsilons = {n: getattr(module, n) for n in ("variance_epsilon", "eps") if hasattr(module, n)}
    for name, eps in epsilons.items():
        if isinstance(eps, bool) or not isinstance(eps, (int, float)):
            return f"{name} is {eps!r}, not a number"
    if len(set(epsilons.values())) > 1:
        return f"variance_epsilon and eps differ ({epsilons}); which one it uses is ambiguous"
    return None


MODULE_CHECKS = dict.fromkeys(
    ("RMSNorm", "RMSNormF32Scale", "RMSNormZeroCentered"), _rmsnorm_module_problem
)
"""Layer name -> check of the host module's state; kernelize leaves modules that fail alone."""
