"""CPU and CUDA tensors: zero-copy DLPack exchange with JAX around an AOT-compiled executable.

Per call: make inputs contiguous, import them (``exchange.py``), look the executable up by
(key, device, shapes, dtypes), run it, export the outputs. Compiling happens once per signature
(``aot.py``). Outputs are fresh XLA buffers, never the inputs, and torch owns them afterwards.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from .. import threads
from ..errors import UnsupportedDeviceError
from ..tensors import needs_x64, tensor_leaves, x64_scope
from .aot import compile_for
from .exchange import Exchange, exchange_for

# Re-exported for runtimes and callers that imported them from here.
__all__ = ["RUNTIME", "DLPackRuntime", "needs_x64", "tensor_leaves", "x64_scope"]


@functools.cache
def _jax_device(device_type: str, index: int) -> Any:
    import jax

    backend = "cpu" if device_type == "cpu" else "gpu"
    try:
        devices = jax.devices(backend)
    except RuntimeError:
        raise UnsupportedDeviceError(
            f"a {device_type} tensor arrived but JAX has no {backend} backend here; "
            f"JAX sees: {', '.join(sorted({d.platform for d in jax.devices()}))}"
        ) from None
    return devices[index if device_type != "cpu" else 0]


def _import(tree: Any, to_jax: Callable[[Any], Any], signature: list) -> Any:
    """JAX arrays for nested lists of tensors; appends each leaf's (shape, dtype) to signature."""
    if tree is None:
        signature.append(None)
        return None
    if isinstance(tree, (list, tuple)):
        signature.append(len(tree))
        return [_import(item, to_jax, signature) for item in tree]
    if not tree.is_contiguous():
        tree = tree.contiguous()
    signature.append((tree.shape, tree.dtype))
    return to_jax(tree)


def _export(tree: Any, to_torch: Callable[[Any], Any]) -> Any:
    if isinstance(tree, (list, tuple)):
        return tuple(_export(item, to_torch) for item in tree)
    return to_torch(tree)


def _first_tensor(tree: Any) -> Any:
    leaves = tensor_leaves(tree)
    if not leaves:
        raise UnsupportedDeviceError("a kernel-hub op call needs at least one tensor argument")
    return leaves[0]


class DLPackRuntime:
    """Tensors go to JAX and back through DLPack; outputs alias XLA's result buffers."""

    def __init__(self) -> None:
        self._exchanges: dict[Any, tuple[Exchange, Any]] = {}
        self._executables: dict[tuple, Any] = {}

    def call(self, jax_fn: Callable[..., Any], tensors: Sequence[Any], *, key: Any = None) -> Any:
        torch_device = _first_tensor(tensors).device
        route = self._exchanges.get(torch_device)
        if route is None:
            route = self._exchanges[torch_device] = self._route(torch_device)
        exchange, device = route
        signature: list = []
        arrays = _import(tensors, exchange.to_jax, signature)
        cache_key = (jax_fn if key is None else key, torch_device, tuple(signature))
        executable = self._executables.get(cache_key)
        if executable is None:
            executable = self._executables[cache_key] = compile_for(jax_fn, tensors, device)
        return _export(executable(*arrays), exchange.to_torch)

    @staticmethod
    def _route(torch_device: Any) -> tuple[Exchange, Any]:
        threads.apply_default_policy()  # before JAX's backends start
        device = _jax_device(torch_device.type, torch_device.index or 0)
        return exchange_for(torch_device.type, device), device


RUNTIME = DLPackRuntime()
