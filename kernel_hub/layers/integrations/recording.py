"""A kernel's Transformers adapter for the slots kernel-hub fills itself (the rotary slot, the
causal-LM loss): read as every adapter is (``FrameworkAdapter``, no attribute defaulted), its
``register()`` also recording the adapter function that the returned name stands for, which the
interface's ``switch`` then installs.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable
from typing import Any

from kernel_hub.declaration import FrameworkAdapter
from kernel_hub.errors import KernelHubError


def recording_adapter(
    kernel: types.ModuleType, function: str, recorded: dict[str, Callable[..., Any]]
) -> FrameworkAdapter | None:
    """``kernel``'s Transformers adapter whose ``register()`` maps the returned name to the
    adapter's ``function`` in ``recorded``; None when the kernel has no Transformers adapter.
    ``KernelHubError`` (kernelize then leaves the slot alone with it) naming what the adapter
    lacks."""
    found = kernel.KERNEL.integration("transformers")
    if found is None:
        return None
    label = f"{kernel.manifest.name} {kernel.manifest.version} integrations"
    adapter = FrameworkAdapter.of(found, label)
    if not hasattr(found, function) or not callable(getattr(found, function)):
        raise KernelHubError(f"{label} lacks the function {function} (kernel-hub calls it)")

    def register() -> Any:
        name = adapter.register()
        recorded[name] = getattr(found, function)
        return name

    return dataclasses.replace(adapter, register=register)
