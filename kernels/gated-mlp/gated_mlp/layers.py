"""Layers whose ``forward`` replaces a Transformers gated MLP's forward (state read from the
host module): ``down_proj(act(gate) * up)`` with the product through the kernel.

* ``GatedMLP``: Llama's ``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` (Llama, Mistral,
  Qwen2/3, Gemma 1/2/3, OLMo, ...);
* ``FusedGatedMLP``: Phi-3's ``gate, up = gate_up_proj(h).chunk(2, -1);
  down_proj(up * activation_fn(gate))``;
* ``GatedMLPActivationFn``: ``GatedMLP`` with the activation held as ``activation_fn`` (Llama 4);
* ``ScaledGatedMLP``: Falcon-H1's ``down_proj(act_fn(gate_proj(x) * gate_multiplier) *
  up_proj(x)) * down_multiplier``.

The projections are called as the host's own submodules, so a projection that is not a plain
``nn.Linear`` (Gemma 4's ``Gemma4ClippableLinear``: clamp, linear, clamp) gives the stock
result too; only the product goes through the kernel.

The activation is read from the host's activation module by its class (``ACTIVATION_CLASSES``);
``MODULE_CHECKS`` leaves alone a module whose activation is another, or whose state is not what
the forward reads. Which class has which form is decided by ``recognise`` (a probe of the
class's forward, used by kernelize's Transformers integration).
"""

from __future__ import annotations

import torch

from . import api

gated_activation = api.gated_activation.torch

ACTIVATION_CLASSES = {
    "SiLU": "silu",
    "SiLUActivation": "silu",
    "GELUActivation": "gelu",
    "GELU": "gelu",
    "PytorchGELUTanh": "gelu_tanh",
    "GELUTanh": "gelu_tanh",
}
"""Activation module class name -> the kernel's activation (checked on values by the module
check: ``GELUActivation`` may run the python erf form, ``nn.GELU`` may be set to tanh)."""


def activation_of(module: torch.nn.Module) -> str:
    return ACTIVATION_CLASSES[type(module).__name__]


class GatedMLP(torch.nn.Module):
    """``down_proj(act_fn(gate_proj(x)) * up_proj(x))``."""

    can_torch_compile = True
    has_backward = True

    def forward(self, x):
        product = gated_activation(self.gate_proj(x), self.up_proj(x), activation_of(self.act_fn))
        return self.down_proj(product)


class FusedGatedMLP(torch.nn.Module):
    """Phi-3's ``down_proj(up * activation_fn(gate))`` with ``gate, up = gate_up_proj(h)``
    halves (gate first); the kernel reads both halves in place."""

    can_torch_compile = True
    has_backward = True

    def forward(self, hidden_states):
        gate_up = self.gate_up_proj(hidden_states)
        return self.down_proj(gated_activation(gate_up, None, activation_of(self.activation_fn)))


class GatedMLPActivationFn(torch.nn.Module):
    """``down_proj(activation_fn(gate_proj(x)) * up_proj(x))``."""

    can_torch_compile = True
    has_backward = True

    def forward(self, x):
        gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(gated_activation(gate, up, activation_of(self.activation_fn)))


class ScaledGatedMLP(torch.nn.Module):
    """``down_proj(act_fn(gate_proj(x) * gate_multiplier) * up_proj(x)) * down_multiplier``:
    the multipliers applied in torch where the stock forward applies them."""

    can_torch_compile = True
    has_backward = True

    def forward(self, x):
        gate = self.gate_proj(x) * self.gate_multiplier
        product = gated_activation(gate, self.up_proj(x), activation_of(self.act_fn))
        return self.down_proj(product) * self.down_multiplier


_REFERENCE = {
    "silu": torch.nn.functional.silu,
    "gelu": torch.nn.functional.gelu,
    "gelu_tanh": lambda g: torch.nn.functional.gelu(g, approximate="tanh"),
}


def _activation_problem(module: object) -> str | None:
    name = ACTIVATION_CLASSES.get(type(module).__name__)
    if name is None:
        known = ", ".join(ACTIVATION_CLASSES)
        return f"its activation is {type(module).__name__}; the kernel serves {known}"
    probe = torch.linspace(-6.0, 6.0, 97)
    with torch.no_grad():
        if not torch.allclose(module(probe), _REFERENCE[name](probe), rtol=1e-6, atol=1e-6):
            return f"its {type(module).__name__} does not compute {name} on a probe"
    return None


def _state_problem(module: torch.nn.Module, linears: tuple[str, ...], act: str) -> str | None:
    for name in linears:
        layer = getattr(module, name, None)
        if not isinstance(layer, torch.nn.Module):
            return f"{name} is {type(layer).__name__}, not a torch.nn.Module"
        if "forward" in layer.__dict__:
            return f"{name}'s forward is replaced on the instance"
        if any(p.device.type == "meta" for p in layer.parameters()):
            return f"{name} is on the meta device (not loaded)"
    return _activation_problem(getattr(module, act, None))


def _multiplier_problem(module: torch.nn.Module) -> str | None:
    for name in ("gate_multiplier", "down_multiplier"):
        value = getattr(module, name, None)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"{name} is {value!r}, not a number"
    return None


_SEPARATE = ("gate_proj", "up_proj", "down_proj")

MODULE_CHECKS = {
    "GatedMLP": lambda m: _state_problem(m, _SEPARATE, "act_fn"),
    "FusedGatedMLP": lambda m: _state_problem(m, ("gate_up_proj", "down_proj"), "activation_fn"),
    "GatedMLPActivationFn": lambda m: _state_problem(m, _SEPARATE, "activation_fn"),
    "ScaledGatedMLP": lambda m: _state_problem(m, _SEPARATE, "act_fn") or _multiplier_problem(m),
}
"""Layer name -> check of the host module's state; kernelize leaves modules that fail alone."""
