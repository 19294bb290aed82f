"""What ``kernelize`` leaves on a model, and whether it is still in place.

kernelize records each forward it swaps on the module it changed, each interface switch and the
report on the model. Other code can undo a swap later without telling kernel-hub: Hugging Face
``kernels``' kernelize resets the forward of every layer it knows to the class's own (or its
kernel's), a user can assign ``module.forward``, a model's attention implementation can be set
again. So the report is rebuilt from what is in place (``verified_report``), never trusted.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from .report import KernelizeReport, ReportEntry

SWAP_ATTRIBUTE = "_kernel_hub_swap"
"""Instance attribute of a swapped module: its ``LayerSwap``."""
INTERFACES_ATTRIBUTE = "_kernel_hub_interfaces"
"""Instance attribute of a kernelized model: interface -> its ``InterfaceSwitch``."""
REPORT_ATTRIBUTE = "_kernel_hub_report"
"""Instance attribute of a kernelized model: (model, mode, device) and the report's entries."""


@dataclass(frozen=True)
class LayerSwap:
    """What a swapped module got, and the instance forward it had before (None: its class's)."""

    layer: str
    kernel: str
    forward: Callable[..., Any]
    previous: Any = None

    def describe(self) -> str:
        return f"{self.kernel} layers.{self.layer}"


@dataclass(frozen=True)
class InterfaceSwitch:
    """A model switched to implementation ``name``; ``previous`` is what the setter restores."""

    name: str
    previous: dict[str, Any]


def foreign_forward(module: torch.nn.Module) -> str | None:
    """What replaced ``module``'s forward on the instance, None if nothing did or if it is the
    class's own forward bound to it (what Hugging Face kernels' kernelize leaves without a
    kernel: the same computation, so it may be swapped and restored)."""
    current = module.__dict__.get("forward")
    if current is None:
        return None
    function = getattr(current, "__func__", None)
    if function is not None and function is getattr(type(module), "forward", None):
        return None
    owner = getattr(function or current, "__qualname__", type(current).__name__)
    origin = getattr(function or current, "__module__", None) or "?"
    return f"{origin}.{owner}"


def install(module: torch.nn.Module, swap: LayerSwap) -> None:
    module.__dict__["forward"] = types.MethodType(swap.forward, module)
    module.__dict__[SWAP_ATTRIBUTE] = swap


def layer_undone(module: torch.nn.Module | None) -> str | None:
    """Why a recorded layer swap is no longer in place, or None while it is."""
    if module is None:
        return "the module is no longer in the model"
    swap = module.__dict__.get(SWAP_ATTRIBUTE)
    if swap is None:
        return "unkernelize removed it"
    current = module.__dict__.get("forward")
    if getattr(current, "__func__", None) is swap.forward and current.__self__ is module:
        return None
    now = foreign_forward(module) or f"{type(module).__name__}.forward (the class's own)"
    return f"its forward was replaced since (now {now}; Hugging Face kernels' kernelize does this)"


def remove(module: torch.nn.Module) -> bool:
    """Undo the module's swap if it is still in place; drop its record either way. True when a
    forward was restored (a swap undone by other code keeps that code's forward)."""
    if SWAP_ATTRIBUTE not in module.__dict__:
        return False
    in_place = layer_undone(module) is None
    swap = module.__dict__.pop(SWAP_ATTRIBUTE)
    if not in_place:
        return False
    if swap.previous is None:
        del module.__dict__["forward"]
    else:
        module.__dict__["forward"] = swap.previous
    return True


def record_report(model: torch.nn.Module, report: KernelizeReport) -> None:
    model.__dict__[REPORT_ATTRIBUTE] = report


def verified_report(
    model: torch.nn.Module, interface_undone: Callable[[torch.nn.Module, str], str | None]
) -> KernelizeReport | None:
    """The model's last kernelize report with every swap checked against the model now: one no
    longer in place is reported left alone, saying what undid it. None if never kernelized.

    ``interface_undone(model, interface_name)`` says why an interface switch is not in place.
    """
    report = model.__dict__.get(REPORT_ATTRIBUTE)
    if report is None:
        return None
    modules = dict(model.named_modules())

    def check(entry: ReportEntry) -> ReportEntry:
        if not entry.swapped:
            return entry
        if entry.kind == "layer":
            problem = layer_undone(modules.get(entry.module))
        else:
            problem = interface_undone(model, entry.target)
        if problem is None:
            return entry
        return replace(
            entry, swapped_to=None, reason=f"was swapped to {entry.swapped_to}, undone: {problem}"
        )

    return replace(report, entries=tuple(check(e) for e in report.entries))
