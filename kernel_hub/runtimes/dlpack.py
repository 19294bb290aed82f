"""CPU and CUDA tensors: zero-copy DLPack exchange with JAX around a jitted function."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import UnsupportedDeviceError

_X64_DTYPES = ("float64", "int64", "uint64", "complex128")


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


def _to_jax(tensor: Any) -> Any:
    import jax

    tensor = tensor.detach()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    return jax.dlpack.from_dlpack(tensor)


def _to_torch(array: Any) -> Any:
    import torch

    return torch.from_dlpack(array)


def tensor_leaves(tree: Any) -> list[Any]:
    """The tensors in nested lists/tuples of tensors and Nones."""
    if isinstance(tree, (list, tuple)):
        return [leaf for item in tree for leaf in tensor_leaves(item)]
    return [] if tree is None else [tree]


def needs_x64(tensors: Any) -> bool:
    return any(str(t.dtype).removeprefix("torch.") in _X64_DTYPES for t in tensor_leaves(tensors))


def x64_scope(enabled: bool) -> contextlib.AbstractContextManager:
    """64-bit JAX types for this call only; the global flag stays as it is."""
    if not enabled:
        return contextlib.nullcontext()
    import jax

    return jax.enable_x64(True)


class DLPackRuntime:
    """Tensors go to JAX and back through DLPack; outputs alias JAX's buffers."""

    def check_device(self, device: Any) -> None:
        _jax_device(device.type, device.index or 0)

    def call(self, jax_fn: Callable[..., Any], tensors: Sequence[Any], *, key: Any = None) -> Any:
        import jax

        first = tensor_leaves(tensors)[0]
        device = _jax_device(first.device.type, first.device.index or 0)
        with x64_scope(needs_x64(tensors)), jax.default_device(device):
            outputs = jax_fn(*jax.tree.map(_to_jax, list(tensors)))
        return jax.tree.map(_to_torch, outputs)


RUNTIME = DLPackRuntime()
