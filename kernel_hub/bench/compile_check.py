"""Compile Pallas kernels for real TPU generations without a TPU (libtpu deviceless topologies).

The Mosaic compiler runs exactly as on a TPU host, so illegal block shapes and VMEM or HBM overflow
for a generation are caught here, not on a user's TPU; an overflow is reported as the memory it
was, with the bytes asked and available (``overflow``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kernel_hub.errors import NoImplementationError, UnknownNameError
from kernel_hub.topologies import (
    DEFAULT_GENERATIONS,
    TOPOLOGIES,
    filtered_libtpu_stderr,
    tpu_device,
)

from .cases import KernelCase, case_dtype, implementation_table, select_cases
from .overflow import memory_overflow

DIRECTIONS: tuple[str, ...] = ("forward", "backward")


def check_generations(generations: Sequence[str]) -> list[str]:
    """The generations, validated before any compile starts."""
    for generation in generations:
        if generation not in TOPOLOGIES:
            raise UnknownNameError("TPU generation", generation, TOPOLOGIES)
    return list(generations)


@dataclass
class CompileResult:
    """One cell of the compile matrix."""

    kernel: str
    case: str
    implementation: str
    dtype: str
    direction: str  # "forward" or "backward"
    generation: str
    ok: bool
    seconds: float
    """Wall seconds to trace, lower and compile (inflated on a loaded machine)."""
    cpu_seconds: float
    """CPU seconds this process spent on it (the compile's cost, whatever the load)."""
    error: str | None = None
    """The compiler's message on failure; the implementation's reason when skipped."""
    vmem_overflow: bool = False
    overflow: dict[str, Any] | None = None
    """{space: 'HBM' | 'VMEM', asked, available} (bytes) when the program did not fit."""
    skipped: bool = False
    """The implementation declined the case's inputs (they fall back to another one)."""
    memory: dict[str, int] = field(default_factory=dict)
    flops: float | None = None
    bytes_accessed: float | None = None

    @property
    def status(self) -> str:
        """'pass', 'fail' or 'skip'."""
        return "pass" if self.ok else "skip" if self.skipped else "fail"

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "status": self.status}


def _staged_function(case: KernelCase, direction: str, implementation: str):
    """The function to compile and its abstract arguments, for a case and direction."""
    import jax

    forward = functools.partial(case.fn, **case.kwargs, implementation=implementation)
    if direction == "forward":
        return forward, case.args
    diff = case.differentiable

    def backward(args, cotangent):
        def on_diff(*diff_args):
            full = list(args)
            for index, value in zip(diff, diff_args, strict=True):
                full[index] = value
            return forward(*full)

        _, pullback = jax.vjp(on_diff, *(args[i] for i in diff))
        return pullback(cotangent)

    out = jax.eval_shape(forward, *case.args)
    return backward, (case.args, out)


def _placed(tree: Any, device: Any) -> Any:
    import jax
    from jax.sharding import SingleDeviceSharding

    sharding = SingleDeviceSharding(device)
    return jax.tree.map(
        lambda s: (
            jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding)
            if isinstance(s, jax.ShapeDtypeStruct)
            else s
        ),
        tree,
    )


def no_persistent_cache() -> contextlib.AbstractContextManager:
    """Deviceless executables cannot be read back from JAX's persistent cache: keep them out.

    libtpu's compile-only client compiles but cannot load an executable ("PjRtCompiler must be
    constructed with a Client to call DeserializeLoadedExecutable", jax 0.10.2 / libtpu 0.0.42):
    an entry written would cost a serialization and a file per compile, and each later read a
    warning and the same compile again. So a deviceless program is compiled once per process
    that asks for it; none is shared between processes."""
    from jax._src import config  # the scoped switch has no public name in jax 0.10

    state = getattr(config, "enable_compilation_cache", None)
    return state(False) if state is not None else contextlib.nullcontext()


def _memory_figures(compiled: Any) -> dict[str, int]:
    stats = compiled.memory_analysis()
    if stats is None:
        return {}
    names = (
        "argument_size_in_bytes",
        "output_size_in_bytes",
        "temp_size_in_bytes",
        "generated_code_size_in_bytes",
    )
    return {name.removesuffix("_in_bytes"): int(getattr(stats, name)) for name in names}


def compile_case(
    kernel: str,
    case: KernelCase,
    generation: str,
    direction: str = "forward",
    implementation: str = "pallas",
) -> CompileResult:
    """Trace, lower and compile one case for one TPU generation.

    Failures are results, not raises; an implementation that declines the inputs is a skip.
    """
    import jax

    device = tpu_device(generation)
    cell = functools.partial(
        CompileResult, kernel, case.name, implementation, case_dtype(case), direction, generation
    )
    start, cpu_start = time.perf_counter(), time.process_time()

    def timed(**fields):
        return cell(
            seconds=time.perf_counter() - start,
            cpu_seconds=time.process_time() - cpu_start,
            **fields,
        )

    try:
        with filtered_libtpu_stderr(), no_persistent_cache(), jax.default_device(device):
            # Output shapes for the backward are traced for the TPU too: what an implementation
            # accepts can depend on the platform.
            fn, args = _staged_function(case, direction, implementation)
            compiled = jax.jit(fn).trace(*_placed(args, device)).lower().compile()
    except NoImplementationError as exc:  # the implementation declines these inputs on TPU
        return timed(ok=False, error=str(exc), skipped=True)
    except Exception as exc:  # the compiler's message is the result
        message = f"{type(exc).__name__}: {exc}".strip()
        overflow = memory_overflow(message)
        return timed(
            ok=False,
            error=message[:2000],
            vmem_overflow=overflow is not None and overflow.space == "VMEM",
            overflow=None if overflow is None else asdict(overflow),
        )
    cost = compiled.cost_analysis() or {}
    if isinstance(cost, list):
        cost = cost[0] if cost else {}
    return timed(
        ok=True,
        memory=_memory_figures(compiled),
        flops=cost.get("flops"),
        bytes_accessed=cost.get("bytes accessed"),
    )


@dataclass(frozen=True)
class CompileTask:
    """One cell of a compile matrix, not yet compiled."""

    kernel: str
    case: KernelCase
    implementation: str
    direction: str
    generation: str
    source: tuple[str, str | None] | None = None
    """(registry op, registry file) to reload the case from in another process."""

    def __str__(self) -> str:
        return f"{self.kernel} {self.case.name} {self.direction} {self.generation}"

    def run(self) -> CompileResult:
        return compile_case(
            self.kernel, self.case, self.generation, self.direction, self.implementation
        )


def plan_matrix(
    kernel: str,
    cases: Sequence[KernelCase],
    generations: Sequence[str],
    directions: Sequence[str],
    implementations: Callable[[KernelCase], Sequence[str]],
) -> list[CompileTask]:
    """Cells for every case x implementation x direction x generation; a case without
    differentiable arguments has no backward cell."""
    generations = check_generations(generations)
    for direction in directions:
        if direction not in DIRECTIONS:
            raise UnknownNameError("direction", direction, DIRECTIONS)
    return [
        CompileTask(kernel, case, implementation, direction, generation)
        for case in cases
        for implementation in implementations(case)
        for direction in directions
        if direction == "forward" or case.differentiable
        for generation in generations
    ]


def compile_matrix(
    kernel: str,
    cases: Sequence[KernelCase],
    generations: Sequence[str] = DEFAULT_GENERATIONS,
    *,
    backward: bool = True,
    implementations: Sequence[str] = ("pallas",),
) -> list[CompileResult]:
    """Compile every case x implementation x direction x generation."""
    directions = DIRECTIONS if backward else ("forward",)
    tasks = plan_matrix(kernel, cases, generations, directions, lambda case: implementations)
    return [task.run() for task in tasks]


def tpu_kernel_implementations(table: Any) -> list[str]:
    """Implementations of a table that compile to TPU kernels: those listing 'tpu', minus the XLA
    references (names starting with 'xla'), which are plain XLA code rather than Pallas/Mosaic.
    """
    return [
        name
        for name, impl in table.implementations.items()
        if "tpu" in impl.platforms and not name.startswith("xla")
    ]


def plan_kernel(
    op: str,
    generations: Sequence[str] = DEFAULT_GENERATIONS,
    *,
    patterns: Sequence[str] | None = None,
    directions: Sequence[str] = DIRECTIONS,
    registry: str | None = None,
) -> list[CompileTask]:
    """The compile matrix of a registry op: its TPU kernel implementations at its benchmark cases
    (all, or those matching ``patterns``)."""
    from kernel_hub.loading.resolver import get_kernel

    kernel = get_kernel(op, registry=registry)
    cases = select_cases(kernel.KERNEL.benchmark_cases, patterns)
    tasks = plan_matrix(
        kernel.manifest.name,
        cases,
        generations,
        directions,
        lambda case: tpu_kernel_implementations(implementation_table(kernel, case)),
    )
    return [dataclasses.replace(task, source=(op, registry)) for task in tasks]


def matrix_record(
    results: Sequence[dict[str, Any]], generations: Sequence[str], command: str
) -> dict[str, Any]:
    """The JSON file of a compile matrix: provenance and every cell (``CompileResult.to_json``)."""
    from .provenance import header

    return {
        "schema": 1,
        "kind": "compile",
        **header(command),
        "generations": list(generations),
        "results": list(results),
    }
