"""Argument checks shared by a kernel's torch op and its JAX function.

They read only ``.shape`` and ``.dtype``, so the same check runs on torch tensors (real or fake),
JAX arrays and ``ShapeDtypeStruct``s, before any JAX work starts.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .errors import KernelInputError

FLOATS = ("float32", "bfloat16")
FLOATS_AND_F64 = ("float32", "bfloat16", "float16", "float64")


def dtype_name(dtype: Any) -> str:
    """'float32' for torch.float32, jnp.float32 or np.dtype('float32')."""
    name = getattr(dtype, "name", None)
    if isinstance(name, str):
        return name
    return str(dtype).removeprefix("torch.")


def check_dtype(op: str, arg: str, value: Any, allowed: Iterable[str]) -> str:
    name = dtype_name(value.dtype)
    allowed = tuple(allowed)
    if name not in allowed:
        raise KernelInputError(f"{op}: {arg} has dtype {name}; supported: {', '.join(allowed)}")
    return name


def check_same_dtype(op: str, first: str, a: Any, second: str, b: Any) -> None:
    """Two arguments that must share a dtype (a kernel computes in one input type)."""
    require(
        dtype_name(a.dtype) == dtype_name(b.dtype),
        f"{op}: {first} is {dtype_name(a.dtype)} but {second} is {dtype_name(b.dtype)}; "
        f"cast them to one dtype",
    )


def check_rank(op: str, arg: str, value: Any, rank: int | tuple[int, int]) -> None:
    """``rank`` is exact, or a (min, max) range."""
    ndim = len(value.shape)
    low, high = (rank, rank) if isinstance(rank, int) else rank
    if not low <= ndim <= high:
        wanted = str(low) if low == high else f"{low} to {high}"
        raise KernelInputError(
            f"{op}: {arg} must have rank {wanted}, got shape {tuple(value.shape)}"
        )


def require(condition: bool, message: str) -> None:
    if not condition:
        raise KernelInputError(message)
