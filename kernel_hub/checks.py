"""Argument checks shared by a kernel's torch op and its JAX function.

They read only ``.shape`` and ``.dtype``, so the same check runs on torch tensors (real or fake),
JAX arrays and ``ShapeDtypeStruct``s, before any JAX work starts; the value checks at the end read
elements too, where they are already on the host (``host_values``), and pass the rest.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import pairwise
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


INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


def host_values(value: Any) -> Any:
    """``value``'s elements as a numpy array when reading them costs no device round trip and no
    trace: a numpy array, a JAX array on the CPU (not a tracer), an eager CPU torch tensor of
    integers (not fake, not while ``torch.compile`` traces); else None. Value checks run on
    these only, so a program on an accelerator is never stalled to check its indices."""
    import numpy as np

    if isinstance(value, np.ndarray):
        return value
    if type(value).__module__.startswith("torch"):
        import torch

        if (
            type(value) not in (torch.Tensor, torch.nn.Parameter)
            or value.device.type != "cpu"
            or torch.compiler.is_compiling()
            or value.dtype.is_floating_point  # indices only (numpy has no bfloat16)
        ):
            return None
        return value.detach().numpy()
    import jax

    if (
        isinstance(value, jax.Array)
        and not isinstance(value, jax.core.Tracer)
        and all(device.platform == "cpu" for device in value.devices())
    ):
        return np.asarray(value)
    return None


def check_int32_values(op: str, arg: str, value: Any) -> Any:
    """Integer indices the kernel reads as int32: wider values (an int64 tensor's) are refused
    where they can be read (:func:`host_values`) rather than wrapped into other ids. Returns
    the values read (None where they could not be), for the caller's further checks."""
    values = host_values(value)
    if values is None or values.size == 0 or values.dtype.itemsize <= 4:
        return values
    low, high = int(values.min()), int(values.max())
    require(
        low >= INT32_MIN and high <= INT32_MAX,
        f"{op}: {arg} holds {low if low < INT32_MIN else high}, outside int32 "
        f"[{INT32_MIN}, {INT32_MAX}], which the kernel reads its indices as",
    )
    return values


def check_offset_values(op: str, arg: str, offsets: Any, total: int) -> None:
    """Packed sequences' offsets (``cu_seqlens``: [N + 1]) where they can be read
    (:func:`host_values`): 0 first, ``total`` last, never decreasing. Others would leave tokens
    out of every sequence, or run sequences over each other."""
    values = check_int32_values(op, arg, offsets)
    if values is None or values.size == 0:
        return
    values = values.tolist()
    require(
        values[0] == 0 and values[-1] == total and all(a <= b for a, b in pairwise(values)),
        f"{op}: {arg} is {values}; it must start at 0, end at {total} (the packed tokens) and "
        "never decrease",
    )
