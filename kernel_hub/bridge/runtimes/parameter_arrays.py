"""Reuse the JAX array of an ``nn.Parameter`` across calls instead of importing it every time.

A weight goes into every call of a layer unchanged; its DLPack import is a quarter of a small
bridged call. The array is reused while the parameter still holds the same memory with the same
shape and dtype. Only zero-copy imports are kept, so in-place updates (optimizer steps) are seen
through the shared memory; an entry goes away with its parameter. CPU only: a CUDA import also
orders JAX after torch's stream, which a reused array would skip.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from .staging import shares_memory


def reuse_parameter_arrays(to_jax: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``to_jax`` that keeps one array per live ``torch.nn.Parameter`` (contiguous ones)."""
    import torch

    parameter_type = torch.nn.Parameter
    entries: dict[int, tuple] = {}

    def forget(key: int) -> Callable[[Any], None]:
        return lambda _dead: entries.pop(key, None)

    def convert(tensor: Any) -> Any:
        if type(tensor) is not parameter_type:
            return to_jax(tensor)
        key = id(tensor)
        entry = entries.get(key)
        if (
            entry is not None
            and entry[0]() is tensor
            and entry[1] == (tensor.data_ptr(), tensor.shape, tensor.dtype)
        ):
            return entry[2]
        # Detached, so the array holds the storage but not the parameter: the weakref can fire.
        array = to_jax(tensor.detach())
        if shares_memory(array, tensor):
            identity = (tensor.data_ptr(), tensor.shape, tensor.dtype)
            entries[key] = (weakref.ref(tensor, forget(key)), identity, array)
        return array

    return convert
