"""kernel-hub: Pallas and Tokamax kernels for PyTorch users.

Public names are imported lazily so ``import kernel_hub`` stays cheap (no jax, no torch).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "get_kernel": ".resolver",
    "load_registry": ".registry",
    "KernelHubError": ".errors",
    "Mode": ".modes",
    "kernel_mapping": ".mappings",
    "KernelizeReport": ".layer_report",
    "kernelize": ".layers",
    "unkernelize": ".layers",
    "use_kernel_forward": ".layers",
    "mark_layer": ".layers",
    "unmark_layer": ".layers",
    "from_pretrained": ".integrations.transformers",
}

if TYPE_CHECKING:
    from .errors import KernelHubError
    from .integrations.transformers import from_pretrained
    from .layer_report import KernelizeReport
    from .layers import kernelize, mark_layer, unkernelize, unmark_layer, use_kernel_forward
    from .mappings import kernel_mapping
    from .modes import Mode
    from .registry import load_registry
    from .resolver import get_kernel


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kernel_hub' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__all__ = [
    "KernelHubError",
    "KernelizeReport",
    "Mode",
    "__version__",
    "from_pretrained",
    "get_kernel",
    "kernel_mapping",
    "kernelize",
    "load_registry",
    "mark_layer",
    "unkernelize",
    "unmark_layer",
    "use_kernel_forward",
]
