"""Benchmark and compile-check cases a kernel declares: representative shapes with their cost.

Each kernel's ``benchmark.py`` exposes ``CASES`` (a list of ``KernelCase``). The same cases drive
``kernel-hub bench`` and ``kernel-hub compile-check``. Cases tagged ``CPU_TAG`` are small enough to
run on a CPU, where Pallas runs in interpret mode; ``kernel-hub bench`` picks them by default there.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from kernel_hub.errors import KernelHubError, KernelInputError, UnknownNameError

DTYPE_ALIASES = {"bf16": "bfloat16", "f32": "float32", "f16": "float16", "f64": "float64"}

CPU_TAG = "cpu"
"""Tag of cases that run in about a second on a 2-core CPU, Pallas (interpret mode) included."""


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
    op: str | None = None
    """Op whose implementation table serves ``fn``; needed only if the kernel has several tables
    and ``fn.__name__`` is not the op's name."""
    make_args: Callable[[Any], tuple[Any, ...]] | None = None
    """``make_args(numpy_generator)`` -> concrete arguments matching ``args``, for running the
    case. Needed when an argument is not floating point (group sizes, indices); otherwise floats
    are drawn from a standard normal."""


def case_dtype(case: KernelCase) -> str:
    """Name of the dtype of the case's first floating-point argument ('bfloat16', ...)."""
    import jax.numpy as jnp

    for arg in case.args:
        if jnp.issubdtype(arg.dtype, jnp.floating):
            return jnp.dtype(arg.dtype).name
    return jnp.dtype(case.args[0].dtype).name if case.args else "none"


def check_drawable(case: KernelCase) -> None:
    """Raise unless ``concrete_args`` can build the case's arguments."""
    import jax.numpy as jnp

    if case.make_args is not None:
        return
    for position, arg in enumerate(case.args):
        if not jnp.issubdtype(arg.dtype, jnp.floating):
            raise KernelInputError(
                f"case {case.name!r}: argument {position} has dtype {jnp.dtype(arg.dtype).name}; "
                "only floating-point arguments can be drawn at random. Give the KernelCase a "
                "make_args(rng) that builds valid concrete arguments."
            )


def concrete_args(case: KernelCase, seed: int = 0) -> tuple[Any, ...]:
    """Host (numpy) arguments for running a case: ``make_args`` or standard-normal floats."""
    import numpy as np

    rng = np.random.default_rng(seed)
    if case.make_args is not None:
        return tuple(case.make_args(rng))
    check_drawable(case)
    return tuple(
        rng.standard_normal(arg.shape, dtype=np.float32).astype(arg.dtype) for arg in case.args
    )


def select_cases(
    cases: Sequence[KernelCase],
    patterns: Iterable[str] | None = None,
    dtype: str | None = None,
    tag: str | None = None,
) -> list[KernelCase]:
    """Cases whose name matches one of ``patterns`` (fnmatch; None: all), of ``dtype``
    ('bfloat16' or 'bf16', ...; None: any), carrying ``tag`` (None: any).

    A pattern or dtype that matches nothing is an error listing what exists.
    """
    names = [c.name for c in cases]
    if len(set(names)) != len(names):
        duplicates = sorted({n for n in names if names.count(n) > 1})
        raise KernelHubError(f"case names must be unique; repeated: {', '.join(duplicates)}")
    chosen = list(cases)
    if patterns is not None:
        patterns = list(patterns)
        for pattern in patterns:
            if not fnmatch.filter(names, pattern):
                raise UnknownNameError("case", pattern, names)
        chosen = [c for c in chosen if any(fnmatch.fnmatchcase(c.name, p) for p in patterns)]
    if dtype is not None:
        dtype = DTYPE_ALIASES.get(dtype, dtype)
        dtypes = {case_dtype(c) for c in chosen}
        if dtype not in dtypes:
            raise UnknownNameError("dtype", dtype, dtypes)
        chosen = [c for c in chosen if case_dtype(c) == dtype]
    if tag is not None:
        chosen = [c for c in chosen if tag in c.tags]
    return chosen


def implementation_table(kernel: ModuleType, case: KernelCase):
    """The ``ImplementationTable`` serving a case: the kernel's only one, or the one for its op."""
    tables = kernel.KERNEL.implementation_tables
    op = case.op or getattr(case.fn, "__name__", None)
    table = kernel.KERNEL.table_for(op)
    if table is not None:
        return table
    ops = ", ".join(t.op for t in tables) or "(none)"
    raise KernelHubError(
        f"case {case.name!r}: cannot tell which implementation table serves it (op {op!r}; the "
        f"kernel's tables are for: {ops}). Set KernelCase.op to one of them."
    )
