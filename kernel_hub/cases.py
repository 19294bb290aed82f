"""Benchmark and compile-check cases a kernel declares: representative shapes with their cost.

Each kernel's ``benchmark.py`` exposes ``CASES`` (a list of ``KernelCase``). The same cases drive
``kernel-hub bench`` and ``kernel-hub compile-check``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class KernelCase:
    """One call of a kernel's JAX function at a representative shape."""

    name: str
    fn: Callable[..., Any]
    """The kernel's public JAX function; takes ``implementation=``."""
    args: tuple[Any, ...]
    """``jax.ShapeDtypeStruct`` per positional argument."""
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    """Static keyword arguments."""
    flops: int = 0
    bytes_accessed: int = 0
    differentiable: tuple[int, ...] = ()
    """Positional arguments the backward pass differentiates (empty: forward only)."""
    tags: tuple[str, ...] = ()
