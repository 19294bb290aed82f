"""CPU and CUDA tensors: zero-copy DLPack exchange with JAX around an AOT-compiled executable.

Per call: make inputs row-major (``row_major``), import them (``exchange.py``; small CPU inputs
are copied into reused buffers instead, ``staging.py``), look the executable up by (key, device,
shapes, dtypes), run it, export the outputs. Compiling happens once per signature (``aot.py``).
Outputs are fresh XLA buffers, never the inputs, and torch owns them afterwards.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from kernel_hub.bridge import threads
from kernel_hub.bridge.tensors import needs_x64, tensor_leaves, x64_scope
from kernel_hub.errors import UnsupportedDeviceError

from .aot import compile_for, fast_call
from .exchange import Exchange, exchange_for
from .staging import InputStaging, synchronous_cpu_dispatch

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


def row_major(tensor: Any) -> Any:
    """``tensor`` with row-major strides, as JAX reads an imported buffer.

    torch calls a tensor contiguous whatever the strides of its size-1 dims (a decode step's
    ``q.view(b, 1, h, d).transpose(1, 2)``), but DLPack hands those strides over and JAX reads
    them as another layout, which an executable compiled for row-major refuses. Such a tensor is
    re-strided: the same memory, a view, no copy.
    """
    if not tensor.is_contiguous():
        return tensor.contiguous()
    shape = tensor.shape
    if 1 not in shape:
        return tensor
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    strides.reverse()
    return tensor if tensor.stride() == tuple(strides) else tensor.as_strided(shape, strides)


def _import(tree: Any, to_jax: Callable[[Any], Any], signature: list) -> Any:
    """JAX arrays for nested lists of tensors; appends each leaf's (shape, dtype) to signature."""
    if tree is None:
        signature.append(None)
        return None
    if isinstance(tree, (list, tuple)):
        signature.append(len(tree))
        return [_import(item, to_jax, signature) for item in tree]
    tree = row_major(tree)
    signature.append((tree.shape, tree.dtype))
    return to_jax(tree)


def _export(tree: Any, to_torch: Callable[[Any], Any]) -> Any:
    if isinstance(tree, (list, tuple)):
        return tuple(_export(item, to_torch) for item in tree)
    return to_torch(tree)


def _one_array(compiled: Any) -> bool:
    """Whether a ``jax.stages.Compiled`` returns one array (not a tuple or list of them)."""
    import jax

    try:
        return isinstance(compiled.out_info, jax.ShapeDtypeStruct)
    except AttributeError:  # another JAX version: the general export is used
        return False


def _first_tensor(tree: Any) -> Any:
    leaves = tensor_leaves(tree)
    if not leaves:
        raise UnsupportedDeviceError("a kernel-hub op call needs at least one tensor argument")
    return leaves[0]


class DLPackRuntime:
    """Tensors go to JAX and back through DLPack; outputs alias XLA's result buffers."""

    # One executable per input shape: ops' row buckets (``buckets.py``) bound how many.
    uses_row_buckets = True

    def __init__(self) -> None:
        self._routes: dict[Any, tuple[Exchange, Any]] = {}
        self._executables: dict[tuple, Any] = {}

    def check_device(self, device: Any) -> None:
        threads.apply_default_policy()  # before JAX's backends start
        _jax_device(device.type, device.index or 0)

    def call(self, jax_fn: Callable[..., Any], tensors: Sequence[Any], *, key: Any = None) -> Any:
        exchange, device = self._route(_first_tensor(tensors).device)
        signature: list = []
        arrays = _import(tensors, exchange.to_jax, signature)
        executable = self._executable(jax_fn, tensors, key, tuple(signature), device)
        return _export(executable(*arrays), exchange.to_torch)

    def bind(
        self, jax_fn: Callable[..., Any], tensors: Sequence[Any], *, key: Any = None
    ) -> Callable[[Sequence[Any]], Any]:
        """``call`` specialised to tensors like ``tensors`` (same nesting, shapes, dtypes and
        device): the caller guarantees that, and the executable is looked up only once. The
        returned call takes a sequence whose first ``len(tensors)`` items are the tensors; items
        after them are ignored (an op may pass its whole argument tuple)."""
        exchange, device = self._route(_first_tensor(tensors).device)
        signature: list = []
        _import(tensors, lambda tensor: None, signature)
        compiled = self._executable(jax_fn, tensors, key, tuple(signature), device)
        executable = fast_call(compiled)
        to_jax, to_torch = exchange.to_jax, exchange.to_torch
        count = len(tensors)
        if any(isinstance(t, (list, tuple)) for t in tensors):
            return lambda tensors: _export(
                executable(*_import(tensors[:count], to_jax, [])), to_torch
            )

        def import_array(tensor: Any) -> Any:
            if tensor is None:
                return None
            return to_jax(row_major(tensor))

        def export(out: Any) -> Any:
            return tuple(map(to_torch, out)) if isinstance(out, (tuple, list)) else to_torch(out)

        if _one_array(compiled):
            export = to_torch

        def run(tensors: Sequence[Any]) -> Any:
            return export(executable(*map(import_array, tensors[:count])))

        if exchange.name != "internal" or not synchronous_cpu_dispatch():
            return run
        return InputStaging(tensors, import_array).bind(executable, export, run)

    def _route(self, torch_device: Any) -> tuple[Exchange, Any]:
        route = self._routes.get(torch_device)
        if route is None:
            threads.apply_default_policy()  # before JAX's backends start
            device = _jax_device(torch_device.type, torch_device.index or 0)
            route = self._routes[torch_device] = (exchange_for(torch_device.type, device), device)
        return route

    def _executable(
        self, jax_fn: Callable[..., Any], tensors: Any, key: Any, signature: tuple, device: Any
    ) -> Any:
        cache_key = (jax_fn if key is None else key, device, signature)
        executable = self._executables.get(cache_key)
        if executable is None:
            executable = self._executables[cache_key] = compile_for(jax_fn, tensors, device)
        return executable


RUNTIME = DLPackRuntime()
