"""Runtime paths: how a JAX computation is run on the tensors of one torch device type.

CPU and CUDA tensors go through DLPack (``dlpack.py``). TPU runtimes plug in here by device type
and are imported only when a tensor of their device arrives.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from ..errors import UnsupportedDeviceError


class Runtime(Protocol):
    """Runs a jitted JAX function on torch tensors of one device type and returns torch tensors.

    ``tensors`` are nested lists of tensors and Nones; ``key`` identifies (op, role, static
    arguments), so a runtime may cache per (key, shapes, dtypes). A runtime may also offer
    ``bind(jax_fn, tensors, *, key) -> run(tensors)``: a call specialised to tensors with the same
    nesting, shapes, dtypes and device as ``tensors``, which callers that already key their
    calls by signature (the executor) use to skip the runtime's own lookup.
    """

    def check_device(self, device: Any) -> None:
        """Raise ``UnsupportedDeviceError`` if this host cannot run JAX for torch ``device``."""

    def call(self, jax_fn: Callable[..., Any], tensors: Sequence[Any], *, key: Any) -> Any: ...


# device type -> module (relative to this package) exposing ``RUNTIME``.
_RUNTIME_MODULES: dict[str, str] = {"cpu": ".dlpack", "cuda": ".dlpack"}


def register_runtime_module(device_type: str, module: str) -> None:
    """Make tensors of ``device_type`` run through ``module.RUNTIME`` (imported on first use)."""
    _RUNTIME_MODULES[device_type] = module


def supported_device_types() -> tuple[str, ...]:
    return tuple(_RUNTIME_MODULES)


def runtime_for(device_type: str) -> Runtime:
    """The runtime for a torch device type; a clear error for device types with no path."""
    module = _RUNTIME_MODULES.get(device_type)
    if module is None:
        raise UnsupportedDeviceError(
            f"kernel-hub ops cannot run on device type {device_type!r}; "
            f"supported device types: {', '.join(supported_device_types())}"
        )
    return importlib.import_module(module, __name__).RUNTIME
