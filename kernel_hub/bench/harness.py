"""Microbenchmark harness: a kernel's benchmark cases x its implementations on this machine.

For each case (``benchmark.CASES``) it times every implementation of the kernel's
``ImplementationTable`` (Pallas, Tokamax, XLA: whichever this platform offers; Pallas on a CPU
runs in interpret mode) and the torch callables the kernel's ``benchmark.TORCH_IMPLEMENTATIONS``
declares (the stock torch path, kernel-hub's own torch op). Compile time (JAX: lower + compile;
torch: the first call) is reported apart from the timed calls, which start after one warm-up call
and are synchronised (``block_until_ready``, ``torch.cuda.synchronize``). Timing is adaptive, see
``kernel_hub.bench.timing``. Achieved FLOP/s, bytes/s and the share of this device's roofline come
from the case's declared FLOPs and bytes (see ``kernel_hub.bench.roofline``).
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kernel_hub.bridge import threads
from kernel_hub.errors import (
    KernelHubError,
    KernelInputError,
    NoImplementationError,
    UnknownNameError,
)
from kernel_hub.platform import Platform, jax_default_device, platform_of_jax_device
from kernel_hub.progress import progress_bar

from .cases import (
    CPU_TAG,
    KernelCase,
    case_dtype,
    check_drawable,
    concrete_args,
    implementation_table,
    select_cases,
)
from .provenance import header
from .roofline import Chip, chip_for_device
from .timing import DEFAULT_POLICY, Timing, TimingPolicy, measure

SCHEMA_VERSION = 1

# torch device type that holds a user's tensors on each platform the harness times torch on.
_TORCH_DEVICES: dict[Platform, str] = {"cpu": "cpu", "gpu": "cuda"}


@dataclass
class BenchResult:
    """One case x implementation: status, cost, timing summary and every sample."""

    op: str
    kernel: str
    kernel_version: str
    case: str
    dtype: str
    implementation: str
    runtime: str
    """'jax' (an implementation-table entry) or 'torch' (a torch callable)."""
    shapes: list[dict[str, Any]]
    kwargs: dict[str, Any]
    flops: int
    bytes_accessed: int
    status: str = "ok"
    """'ok', 'skipped' (the implementation declined the inputs here) or 'error'."""
    reason: str | None = None
    compile_s: float | None = None
    samples_s: list[float] = field(default_factory=list)
    median_s: float | None = None
    p10_s: float | None = None
    p90_s: float | None = None
    iqr_s: float | None = None
    flops_per_s: float | None = None
    bytes_per_s: float | None = None
    compute_share: float | None = None
    bandwidth_share: float | None = None
    roofline_share: float | None = None

    def record_timing(self, timing: Timing, chip: Chip | None) -> None:
        self.samples_s = list(timing.samples)
        self.median_s, self.p10_s, self.p90_s = timing.median, timing.p10, timing.p90
        self.iqr_s = timing.iqr
        self.flops_per_s = self.flops / timing.median
        self.bytes_per_s = self.bytes_accessed / timing.median
        if chip is not None and (self.flops or self.bytes_accessed):
            for name, value in chip.shares(self.flops, self.bytes_accessed, timing.median).items():
                setattr(self, name, value)


@dataclass
class BenchReport:
    """A run of ``kernel-hub bench``: provenance, this device's roofline, the results."""

    header: dict[str, Any]
    platform: str
    chip: Chip | None
    policy: TimingPolicy
    results: list[BenchResult]

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA_VERSION,
            "kind": "bench",
            **self.header,
            "platform": self.platform,
            "chip": self.chip.to_json() if self.chip is not None else None,
            "timing_policy": asdict(self.policy),
            "results": [asdict(r) for r in self.results],
        }

    def write_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @property
    def failed(self) -> list[BenchResult]:
        return [r for r in self.results if r.status == "error"]


def _shapes(case: KernelCase) -> list[dict[str, Any]]:
    import jax.numpy as jnp

    return [{"shape": list(a.shape), "dtype": jnp.dtype(a.dtype).name} for a in case.args]


def _json_kwargs(case: KernelCase) -> dict[str, Any]:
    plain = (bool, int, float, str, type(None))
    return {k: v if isinstance(v, plain) else repr(v) for k, v in case.kwargs.items()}


def _time_jax(case: KernelCase, implementation: str, host_args, device, policy, result) -> Timing:
    import jax

    call = jax.jit(functools.partial(case.fn, **case.kwargs, implementation=implementation))
    args = [jax.device_put(a, device) for a in host_args]
    start = time.perf_counter()
    compiled = call.lower(*args).compile()
    result.compile_s = time.perf_counter() - start
    jax.block_until_ready(compiled(*args))  # warm-up
    return measure(lambda: jax.block_until_ready(compiled(*args)), policy)


def _to_torch(value: Any, device: str):
    import numpy as np
    import torch

    # ml_dtypes types (bfloat16, ...) are not numpy builtins and torch.from_numpy refuses them.
    host = value if value.dtype.isbuiltin == 1 else value.astype(np.float32)
    tensor = torch.from_numpy(np.ascontiguousarray(host))
    # copied into torch's own (64-byte aligned) memory, as a model's tensors are: numpy's
    # 16-byte alignment would make JAX copy the input on every bridged call
    return tensor.to(device=device, dtype=getattr(torch, value.dtype.name), copy=True)


def _time_torch(fn: Callable, case: KernelCase, host_args, torch_device: str, policy, result):
    import torch

    def sync() -> None:
        if torch_device == "cuda":
            torch.cuda.synchronize()

    tensors = [_to_torch(a, torch_device) for a in host_args]
    with torch.no_grad():
        start = time.perf_counter()
        fn(*tensors, **case.kwargs)
        sync()
        result.compile_s = time.perf_counter() - start  # first call: dispatch set-up, caches

        def call() -> None:
            fn(*tensors, **case.kwargs)
            sync()

        return measure(call, policy)


def kernel_cases(kernel: Any, platform: Platform, patterns, dtype) -> list[KernelCase]:
    """The cases to run: by name patterns, else the CPU-sized ones on a CPU and all elsewhere."""
    cases = kernel.KERNEL.benchmark_cases
    tag = CPU_TAG if patterns is None and platform == "cpu" else None
    chosen = select_cases(cases, patterns, dtype, tag)
    if not chosen:
        names = ", ".join(c.name for c in cases)
        raise KernelHubError(
            f"kernel {kernel.manifest.name} declares no benchmark case tagged {tag!r} for "
            f"{platform}; choose with --shapes from: {names}"
        )
    return chosen


def _implementations(
    kernel: Any, cases: Sequence[KernelCase], wanted: Sequence[str] | None
) -> list[tuple[KernelCase, str, Callable | None]]:
    """(case, implementation, torch callable or None for a table entry) cells to run."""
    torch_impls: Mapping[str, Callable] = kernel.KERNEL.torch_implementations
    per_case = {c.name: [*implementation_table(kernel, c).names, *torch_impls] for c in cases}
    known = {name for names in per_case.values() for name in names}
    for name in wanted or ():
        if name not in known:
            raise UnknownNameError(f"implementation of {kernel.manifest.name}", name, known)
    return [
        (case, name, torch_impls.get(name))
        for case in cases
        for name in per_case[case.name]
        if wanted is None or name in wanted
    ]


def bench_op(
    op: str,
    *,
    implementations: Sequence[str] | None = None,
    patterns: Sequence[str] | None = None,
    dtype: str | None = None,
    policy: TimingPolicy = DEFAULT_POLICY,
    progress: bool = True,
    registry: str | None = None,
) -> list[BenchResult]:
    """Time a registry op's cases on the default JAX device (and its torch counterpart)."""
    from kernel_hub.loading.resolver import get_kernel

    kernel = get_kernel(op, registry=registry)
    device = jax_default_device()
    platform = platform_of_jax_device(device)
    cases = kernel_cases(kernel, platform, patterns, dtype)
    for case in cases:  # a case that cannot be run is a declaration error: say so before timing
        check_drawable(case)
    cells = _implementations(kernel, cases, implementations)
    chip = chip_for_device(device)
    bar = progress_bar(len(cells), enabled=progress)
    results = []
    drawn_for, host_args = None, ()
    try:
        for case, name, torch_fn in cells:
            if drawn_for is not case:  # cells come case by case: one draw per case
                drawn_for, host_args = case, concrete_args(case)
            bar.set_description(f"{op} {case.name} {name}")
            results.append(
                _run_cell(op, kernel, case, host_args, name, torch_fn, device, chip, policy)
            )
            bar.update()
    finally:
        bar.close()
    return results


def _run_cell(op, kernel, case, host_args, name, torch_fn, device, chip, policy) -> BenchResult:
    result = BenchResult(
        op=op,
        kernel=kernel.manifest.name,
        kernel_version=str(kernel.manifest.version),
        case=case.name,
        dtype=case_dtype(case),
        implementation=name,
        runtime="jax" if torch_fn is None else "torch",
        shapes=_shapes(case),
        kwargs=_json_kwargs(case),
        flops=case.flops,
        bytes_accessed=case.bytes_accessed,
    )
    platform = platform_of_jax_device(device)
    if torch_fn is not None and platform not in _TORCH_DEVICES:
        result.status = "skipped"
        result.reason = f"torch paths are timed on {', '.join(_TORCH_DEVICES)} only"
        return result
    try:
        if torch_fn is None:
            timing = _time_jax(case, name, host_args, device, policy, result)
        else:
            torch_device = _TORCH_DEVICES[platform]
            timing = _time_torch(torch_fn, case, host_args, torch_device, policy, result)
    except NoImplementationError as exc:
        result.status, result.reason = "skipped", str(exc)
        return result
    except Exception as exc:  # a broken implementation is a result; the other cells still run
        result.status, result.reason = "error", f"{type(exc).__name__}: {exc}"[:2000]
        return result
    result.record_timing(timing, chip)
    return result


def run_benchmarks(
    ops: Sequence[str],
    *,
    command: str,
    policy: TimingPolicy = DEFAULT_POLICY,
    torch_threads: int | None = None,
    **options: Any,
) -> BenchReport:
    """``bench_op`` for each op, with provenance and this device's roofline.

    ``torch_threads`` sets ``torch.set_num_threads`` for the run: on a loaded host, torch's
    parallel regions wait for descheduled threads, and one thread can be faster.
    """
    import torch

    if torch_threads is not None:
        if torch_threads < 1:
            raise KernelInputError(f"torch threads must be >= 1, got {torch_threads}")
        torch.set_num_threads(torch_threads)
    # Torch-op rows measure the bridge as users get it: its thread policy must be in force before
    # the harness itself starts JAX's backends.
    threads.apply_default_policy()
    device = jax_default_device()
    # taken before the runs, so its load average is the one they met
    provenance = {**header(command), "torch_threads": torch.get_num_threads()}
    results = []
    for op in ops:
        results += bench_op(op, policy=policy, **options)
    return BenchReport(
        header=provenance,
        platform=platform_of_jax_device(device),
        chip=chip_for_device(device),
        policy=policy,
        results=results,
    )
