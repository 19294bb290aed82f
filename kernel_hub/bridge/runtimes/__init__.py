"""Runtime paths: how a JAX computation is run on the tensors of one torch device type.

CPU and CUDA tensors go through DLPack (``dlpack.py``); the TPU runtimes are TorchTPU (device
``"tpu"``, ``torch_tpu.py``), torchax (``"jax"``, ``torchax.py``) and PyTorch/XLA (``"xla"``,
``torch_xla.py``). A runtime module, and the library behind it, is imported only when a tensor of
its device arrives.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, Protocol

from kernel_hub.bridge.import_watch import when_imported
from kernel_hub.errors import UnsupportedDeviceError


class Runtime(Protocol):
    """Runs a jitted JAX function on torch tensors of one device type and returns torch tensors.

    ``tensors`` are nested lists of tensors and Nones; ``key`` is (op, role, static
    arguments, implementation-order generation), so a runtime may cache per (key, shapes,
    dtypes). A runtime may also offer
    ``bind(jax_fn, tensors, *, key) -> run(tensors)``: a call specialised to tensors with the same
    nesting, shapes, dtypes and device as ``tensors``, which callers that already key their
    calls by signature (the executor) use to skip the runtime's own lookup. A runtime that
    compiles once per input shape may set ``uses_row_buckets = True`` so ops that declare
    ``RowBuckets`` pad their rows to a few sizes before calling it; others get tensors as they are.
    """

    def check_device(self, device: Any) -> None:
        """Raise ``UnsupportedDeviceError`` if this host cannot run JAX for torch ``device``."""

    def call(self, jax_fn: Callable[..., Any], tensors: Sequence[Any], *, key: Any) -> Any: ...


# device type -> module (relative to this package) exposing ``RUNTIME``.
_RUNTIME_MODULES: dict[str, str] = {
    "cpu": ".dlpack",
    "cuda": ".dlpack",
    "tpu": ".torch_tpu",
    "jax": ".torchax",
    "xla": ".torch_xla",
}

# Libraries that decide what an op does before the op's own kernel runs (torchax handles every op
# inside its tensor class): their runtime module must register each op with them, as soon as both
# the op and the library exist. library -> runtime module exposing ``register(op)``.
_OP_REGISTERING_RUNTIMES: dict[str, str] = {"torchax": ".torchax"}


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
    return _runtime_module(module).RUNTIME


def op_defined(op: Any) -> None:
    """Called by the bridge for every new op (a ``JaxOp``): hand it to the runtimes that need it.

    A runtime whose library is already imported registers the op now, otherwise right after the
    library's first import; kernel-hub never imports the library itself.
    """
    for library, module in _OP_REGISTERING_RUNTIMES.items():
        when_imported(library, lambda _library, module=module: _runtime_module(module).register(op))


def _runtime_module(module: str) -> ModuleType:
    return importlib.import_module(module, __name__)
