"""Transformers gated MLPs: which forward form a class computes, decided by a probe.

A Transformers class whose name ends with ``MLP`` and whose forward reads ``gate_proj`` or
``gate_up_proj`` is a gated-MLP candidate. Its forward runs on a probe holding small
``nn.Linear`` projections and a stand-in activation (``sin``, so a misplaced or missing
activation shows) under every attribute name a form uses, and must equal one form's torch
formula exactly, reading only that form's attributes:

* ``GatedMLP``: ``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` (Llama, Mistral, Qwen2/3,
  Gemma 1/2/3, OLMo, ...);
* ``FusedGatedMLP``: ``gate, up = gate_up_proj(x).chunk(2, -1)``, then
  ``down_proj(up * activation_fn(gate))`` (Phi-3);
* ``GatedMLPActivationFn``: ``GatedMLP`` with the activation held as ``activation_fn``
  (Llama 4);
* ``ScaledGatedMLP``: ``down_proj(act_fn(gate_proj(x) * gate_multiplier) * up_proj(x)) *
  down_multiplier`` (Falcon-H1's µP multipliers; the probe's multipliers are not 1).

A near miss (a bias after the product, other state, another order of halves) is refused with the
reason. Which activation an instance uses is the gated-mlp kernel's module check.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MLPForm:
    layer: str
    formula: str
    reads: frozenset[str]
    reference: Callable[[dict, torch.Tensor], torch.Tensor]


def _separate(state: dict, x: torch.Tensor) -> torch.Tensor:
    return state["down_proj"](state["act_fn"](state["gate_proj"](x)) * state["up_proj"](x))


def _fused(state: dict, x: torch.Tensor) -> torch.Tensor:
    gate, up = state["gate_up_proj"](x).chunk(2, dim=-1)
    return state["down_proj"](up * state["activation_fn"](gate))


def _separate_activation_fn(state: dict, x: torch.Tensor) -> torch.Tensor:
    gate = state["activation_fn"](state["gate_proj"](x))
    return state["down_proj"](gate * state["up_proj"](x))


def _scaled(state: dict, x: torch.Tensor) -> torch.Tensor:
    gate = state["act_fn"](state["gate_proj"](x) * state["gate_multiplier"])
    return state["down_proj"](gate * state["up_proj"](x)) * state["down_multiplier"]


MLP_FORMS = (
    MLPForm(
        "GatedMLP",
        "down_proj(act_fn(gate_proj(x)) * up_proj(x))",
        frozenset({"gate_proj", "up_proj", "down_proj", "act_fn"}),
        _separate,
    ),
    MLPForm(
        "FusedGatedMLP",
        "down_proj(up * activation_fn(gate)), gate, up = gate_up_proj(x).chunk(2, -1)",
        frozenset({"gate_up_proj", "down_proj", "activation_fn"}),
        _fused,
    ),
    MLPForm(
        "GatedMLPActivationFn",
        "down_proj(activation_fn(gate_proj(x)) * up_proj(x))",
        frozenset({"gate_proj", "up_proj", "down_proj", "activation_fn"}),
        _separate_activation_fn,
    ),
    MLPForm(
        "ScaledGatedMLP",
        "down_proj(act_fn(gate_proj(x) * gate_multiplier) * up_proj(x)) * down_multiplier",
        frozenset({"gate_proj", "up_proj", "down_proj", "act_fn", "gate_multiplier"})
        | {"down_multiplier"},
        _scaled,
    ),
)
_GATES = ("gate_proj", "gate_up_proj")


class _Sin(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x)


def _probe_state() -> dict:
    generator = torch.Generator().manual_seed(0)

    def linear(n_in: int, n_out: int) -> torch.nn.Linear:
        with torch.random.fork_rng(devices=[]):  # kernelize leaves the global RNG alone
            layer = torch.nn.Linear(n_in, n_out, bias=False)
        with torch.no_grad():
            layer.weight.copy_(torch.randn(n_out, n_in, generator=generator))
        return layer

    return {
        "gate_proj": linear(8, 12),
        "up_proj": linear(8, 12),
        "gate_up_proj": linear(8, 24),
        "down_proj": linear(12, 8),
        "act_fn": _Sin(),
        "activation_fn": _Sin(),
        "gate_multiplier": 0.3,
        "down_multiplier": 1.7,
    }


def is_gated_mlp_candidate(cls: type) -> bool:
    """A Transformers ``*MLP`` class whose forward reads a gate projection."""
    if not (cls.__module__.startswith("transformers.") and cls.__name__.endswith("MLP")):
        return False
    code = getattr(getattr(cls, "forward", None), "__code__", None)
    return code is not None and any(name in code.co_names for name in _GATES)


@dataclass(frozen=True)
class MLPRecognition:
    layer: str | None
    reason: str | None = None


@functools.cache
def recognise_mlp(cls: type, probe_class: type) -> MLPRecognition:
    """Which of ``MLP_FORMS`` ``cls.forward`` computes (see the module docstring).

    ``probe_class(cls, state)`` builds the stand-in instance (the Transformers integration's
    ``_Probe``: class methods bound, reads recorded, unknown attributes refused)."""
    state = _probe_state()
    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(1))
    forms = "; ".join(f"{f.layer}: {f.formula}" for f in MLP_FORMS)
    probe = probe_class(cls, state)
    try:
        with torch.no_grad():
            out = cls.forward(probe, x)
    except Exception as exc:  # other state or arguments: not a form served here
        return MLPRecognition(
            None,
            f"its forward is none of the gated MLP forms ({forms}): {type(exc).__name__}: {exc}",
        )
    read = object.__getattribute__(probe, "_probe")[2]
    for form in MLP_FORMS:
        if read <= form.reads | {"training"} and form.reads <= read | {"training"}:
            expected = form.reference(state, x)
            if isinstance(out, torch.Tensor) and torch.equal(out, expected):
                return MLPRecognition(form.layer)
            return MLPRecognition(
                None,
                f"its forward reads {sorted(read)} as {form.layer} does, but its result differs "
                f"from {form.formula} (e.g. a bias or scale after the product)",
            )
    return MLPRecognition(
        None, f"its forward reads {sorted(read)}: none of the gated MLP forms ({forms})"
    )
