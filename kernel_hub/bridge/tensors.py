"""Helpers over an op's tensor arguments: nested lists of torch tensors and Nones.

Nothing here imports jax or torch at module import.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

_X64_DTYPES = ("float64", "int64", "uint64", "complex128")


def torch_to_jax_dtype(dtype: Any) -> Any:
    """The JAX dtype for a torch dtype; a clear error for dtypes JAX cannot hold."""
    import jax

    from kernel_hub.errors import KernelInputError

    name = str(dtype).removeprefix("torch.")
    try:
        return jax.numpy.dtype(name)
    except TypeError:
        raise KernelInputError(f"dtype {dtype} has no JAX equivalent") from None


def tensor_leaves(tree: Any) -> list[Any]:
    """The tensors in nested lists/tuples of tensors and Nones."""
    if isinstance(tree, (list, tuple)):
        return [leaf for item in tree for leaf in tensor_leaves(item)]
    return [] if tree is None else [tree]


def map_tensors(fn: Callable[[Any], Any], tree: Any) -> Any:
    """``fn`` applied to every tensor; lists/tuples become lists, Nones stay."""
    if isinstance(tree, (list, tuple)):
        return [map_tensors(fn, item) for item in tree]
    return None if tree is None else fn(tree)


def needs_x64(tensors: Any) -> bool:
    """Whether any tensor has a 64-bit dtype (JAX keeps those only with x64 enabled)."""
    return any(str(t.dtype).removeprefix("torch.") in _X64_DTYPES for t in tensor_leaves(tensors))


def x64_scope(enabled: bool) -> contextlib.AbstractContextManager:
    """64-bit JAX types for this block only; the global flag stays as it is."""
    if not enabled:
        return contextlib.nullcontext()
    import jax

    return jax.enable_x64(True)
