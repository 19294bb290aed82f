"""kernel-hub: Pallas and Tokamax kernels for PyTorch users.

Public names are imported lazily so ``import kernel_hub`` stays cheap (no jax, no torch).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .version import __version__

_EXPORTS = {
    "get_kernel": ".loading.resolver",
    "load_registry": ".registry.registry",
    "KernelHubError": ".errors",
    "Mode": ".layers.modes",
    "kernel_mapping": ".loading.mappings",
    "KernelizeReport": ".layers.report",
    "KernelizeCallback": ".layers.integrations.trainer",
    "kernelize": ".layers.kernelize",
    "kernelize_report": ".layers.kernelize",
    "unkernelize": ".layers.kernelize",
    "use_kernel_forward": ".layers.kernelize",
    "mark_layer": ".layers.kernelize",
    "unmark_layer": ".layers.kernelize",
    "from_pretrained": ".layers.kernelize",
    "use_mesh": ".sharding",
    "quantize_experts": ".layers.quantize",
    "quantize_linear": ".layers.quantized_linear",
}

if TYPE_CHECKING:
    from .errors import KernelHubError
    from .layers.integrations.trainer import KernelizeCallback
    from .layers.kernelize import (
        from_pretrained,
        kernelize,
        kernelize_report,
        mark_layer,
        unkernelize,
        unmark_layer,
        use_kernel_forward,
    )
    from .layers.modes import Mode
    from .layers.quantize import quantize_experts
    from .layers.quantized_linear import quantize_linear
    from .layers.report import KernelizeReport
    from .loading.mappings import kernel_mapping
    from .loading.resolver import get_kernel
    from .registry.registry import load_registry
    from .sharding import use_mesh


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
    "KernelizeCallback",
    "KernelizeReport",
    "Mode",
    "__version__",
    "from_pretrained",
    "get_kernel",
    "kernel_mapping",
    "kernelize",
    "kernelize_report",
    "load_registry",
    "mark_layer",
    "quantize_experts",
    "quantize_linear",
    "unkernelize",
    "unmark_layer",
    "use_kernel_forward",
    "use_mesh",
]
