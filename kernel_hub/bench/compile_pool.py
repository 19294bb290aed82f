"""Run the cells of a compile matrix in parallel worker processes.

A Mosaic/XLA compile uses one core, so N workers finish a large matrix about N times sooner on
an N-core machine. Workers are spawned, never forked (JAX is not fork-safe), and reload each
kernel from the registry by name, because loaded kernel modules do not pickle.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed

from kernel_hub.errors import KernelHubError, KernelInputError
from kernel_hub.topologies import allow_shared_libtpu

from .compile_check import CompileResult, CompileTask, compile_case


def _compile_by_name(
    op: str,
    registry: str | None,
    case_name: str,
    implementation: str,
    direction: str,
    generation: str,
) -> CompileResult:
    """Worker side: load the kernel, find the case, compile it."""
    from kernel_hub.loading.resolver import get_kernel

    kernel = get_kernel(op, registry=registry)
    case = next(c for c in kernel.KERNEL.benchmark_cases if c.name == case_name)
    return compile_case(kernel.manifest.name, case, generation, direction, implementation)


def resolve_jobs(jobs: int) -> int:
    """Worker count: ``jobs``, or one per CPU for 0."""
    if jobs < 0:
        raise KernelInputError(f"jobs must be >= 0 (0: one per CPU), got {jobs}")
    return jobs or os.cpu_count() or 1


def run_tasks(
    tasks: Sequence[CompileTask],
    jobs: int = 1,
    on_result: Callable[[CompileTask, CompileResult], None] | None = None,
) -> list[CompileResult]:
    """Compile every task, in this process (``jobs`` 1) or in ``jobs`` workers (0: one per CPU);
    results come back in task order, ``on_result`` is called as each one finishes."""
    jobs = resolve_jobs(jobs)
    notify = on_result or (lambda task, result: None)
    if jobs == 1:
        results = []
        for task in tasks:
            results.append(task.run())
            notify(task, results[-1])
        return results
    orphans = [str(task) for task in tasks if task.source is None]
    if orphans:
        raise KernelHubError(
            f"cannot compile in workers cells planned without a registry op: {orphans[0]}, ..."
        )
    allow_shared_libtpu()  # inherited by the workers, which all load libtpu
    results: list[CompileResult | None] = [None] * len(tasks)
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=min(jobs, len(tasks)) or 1, mp_context=context) as pool:
        pending = {
            pool.submit(
                _compile_by_name,
                *task.source,
                task.case.name,
                task.implementation,
                task.direction,
                task.generation,
            ): index
            for index, task in enumerate(tasks)
        }
        for future in as_completed(pending):
            index = pending[future]
            results[index] = future.result()
            notify(tasks[index], results[index])
    return results
