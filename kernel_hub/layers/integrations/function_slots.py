"""Function slots: module-level functions a kernel layer's forward looks up on its module first.

Transformers' hybrid mixers call module-level functions (``causal_conv1d_fn``,
``causal_conv1d_update``) that Hugging Face ``kernels`` may fill for CUDA. Replacing such a global
would change every model of the class in the process, so kernel-hub fills them per instance
instead, and only where a kernel layer's swapped forward reads them from its module (the forward
declares ``function_slots = (names)``; ``GatedDeltaNet`` does). Stock forwards that call the
globals are reported left alone with that reason. The serving kernel's ``integrations.register()``
returns ``{slot name: function}`` with the stock functions' signatures; ``unkernelize`` (and
each ``kernelize``) removes the functions again.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kernel_hub.errors import KernelHubError
from kernel_hub.layers.swaps import SWAP_ATTRIBUTE

SLOTS_ATTRIBUTE = "function_slots"
"""Attribute of a kernel layer's forward: the slot names it looks up on its module."""


def _label(functions: dict[str, Any]) -> str:
    return ", ".join(f"{slot}={getattr(fn, '__name__', fn)}" for slot, fn in functions.items())


@dataclass(frozen=True)
class FunctionSlotInterface:
    """kernelize's switch of one group of function slots to the kernel of registry op ``op``."""

    slots: tuple[str, ...]
    op: str
    name: str
    calls_global: Callable[[type, str], bool]
    """Whether a class's own forward calls the module-level function of that name."""
    kind: str = "function slots"

    def _reads_slots(self, module: torch.nn.Module) -> bool:
        swap = module.__dict__.get(SWAP_ATTRIBUTE)
        declared = getattr(getattr(swap, "forward", None), SLOTS_ATTRIBUTE, ())
        return swap is not None and set(self.slots) <= set(declared)

    def dispatches(self, module: torch.nn.Module) -> bool:
        return self._reads_slots(module)

    def unreached(self, model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, str]]:
        """Modules whose own forward calls the module-level functions: left alone."""
        return [
            (
                name,
                module,
                f"its forward calls the module-level {' / '.join(self.slots)}; kernel-hub fills "
                "them only for a swapped kernel layer that reads them from its module (replacing "
                "the globals would change every model of the class)",
            )
            for name, module in model.named_modules()
            if not self._reads_slots(module)
            and all(self.calls_global(type(module), slot) for slot in self.slots)
        ]

    def integration(self, kernel: types.ModuleType) -> Any:
        return kernel.KERNEL.integration("transformers")

    def model_problem(self, model: torch.nn.Module, modules: list) -> str | None:
        return None

    def _filled(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        return [m for m in model.modules() if any(s in m.__dict__ for s in self.slots)]

    def current(self, model: torch.nn.Module) -> dict[str, Any]:
        """{"": the label of the functions in the slots, None when none are filled}."""
        filled = self._filled(model)
        if not filled:
            return {"": None}
        return {"": _label({s: filled[0].__dict__.get(s) for s in self.slots})}

    def switch(self, model: torch.nn.Module, functions: Any) -> str:
        if not isinstance(functions, dict) or set(functions) != set(self.slots):
            raise KernelHubError(
                f"integrations.register() returned {functions!r}; a {self.name} provider "
                f"returns {{name: function}} for exactly {', '.join(self.slots)}"
            )
        for module in model.modules():
            if self._reads_slots(module):
                module.__dict__.update({s: functions[s] for s in self.slots})
        return _label({s: functions[s] for s in self.slots})

    def restore(self, model: torch.nn.Module, previous: dict[str, Any]) -> None:
        for module in self._filled(model):
            for slot in self.slots:
                module.__dict__.pop(slot, None)
