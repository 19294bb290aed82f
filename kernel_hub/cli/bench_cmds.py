"""``kernel-hub bench``: time a kernel's benchmark cases on this machine, per implementation."""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict

from kernel_hub.errors import KernelHubError

from .options import comma_list, ops_from_args, require_modules
from .output import print_table, print_wrapped


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="microbenchmark kernels on this machine",
        description="Time each benchmark case of an op for every implementation available here "
        "(Pallas, Tokamax, XLA, the torch paths). On a CPU the cases tagged 'cpu' run by "
        "default (Pallas runs in interpret mode there); --shapes chooses others.",
    )
    parser.add_argument("ops", nargs="*", metavar="OP", help="registry op name(s)")
    parser.add_argument("--all", action="store_true", help="every op of the registry")
    parser.add_argument("--impl", type=comma_list, help="implementations, e.g. pallas,xla,torch")
    parser.add_argument(
        "--shapes", type=comma_list, help="case names or fnmatch patterns, e.g. 'decode-*'"
    )
    parser.add_argument("--dtype", help="only cases of this dtype (bf16, f32, bfloat16, ...)")
    parser.add_argument("--json", metavar="PATH", help="write every sample and the machine")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG of time and roofline share")
    parser.add_argument(
        "--budget", type=float, default=1.0, help="seconds of timed calls per cell (default 1)"
    )
    parser.add_argument("--min-samples", type=int, default=5, help="timed calls at least")
    parser.add_argument("--max-samples", type=int, default=1000, help="timed calls at most")
    parser.add_argument(
        "--precision",
        type=float,
        default=0.01,
        help="stop early once the median's relative standard error is below this (default 0.01)",
    )
    parser.add_argument(
        "--torch-threads", type=int, help="torch.set_num_threads for the run (default: torch's)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.add_argument("--registry", help="registry file (default: the in-tree registry.yaml)")
    parser.set_defaults(func=run_bench)


def _thread_note(asked: int | None) -> str:
    """The two sides' threads: they differ, and on a small or busy host that decides the race."""
    import torch

    from kernel_hub.bridge.threads import thread_policy

    source = "--torch-threads" if asked else "torch's default; --torch-threads 1 to compare"
    return (
        f"threads: torch and torch-op ran with torch.set_num_threads({torch.get_num_threads()}) "
        f"({source}); JAX's computations use XLA's CPU thread pool, dispatched on the calling "
        f"thread (KERNEL_HUB_THREADS={thread_policy()}). torch's OpenMP threads spin after each "
        "call and contend with XLA's on a few cores, so a CPU 'win' here can be thread contention."
    )


def run_bench(args: argparse.Namespace) -> int:
    from kernel_hub.bench.harness import run_benchmarks
    from kernel_hub.bench.provenance import command_line
    from kernel_hub.bench.report import BENCH_HEADERS, bench_row
    from kernel_hub.bench.timing import TimingPolicy

    if args.plot:
        require_modules("matplotlib")  # before minutes of timing, not after
    policy = TimingPolicy(args.budget, args.min_samples, args.max_samples, args.precision)
    report = run_benchmarks(
        ops_from_args(args),
        command=command_line("kernel-hub", args.argv),
        policy=policy,
        implementations=args.impl,
        patterns=args.shapes,
        dtype=args.dtype,
        progress=not args.no_progress,
        registry=args.registry,
        torch_threads=args.torch_threads,
    )
    results = [asdict(r) for r in report.results]
    print_table(BENCH_HEADERS, [bench_row(r) for r in results])
    print()
    print_wrapped(_thread_note(args.torch_threads))
    chip = report.chip
    if chip is None:
        print(f"\nroofline: no figures for this {report.platform} device; shares not computed")
    else:
        kind = "measured" if chip.measured else "published"
        print(
            f"\nroofline ({kind}): {chip.name}: {chip.peak_flops / 1e9:.4g} GFLOP/s, "
            f"{chip.memory_bandwidth / 1e9:.4g} GB/s"
        )
    if args.json:
        report.write_json(args.json)
        print(f"wrote {args.json}")
    if args.plot:
        from kernel_hub.bench.plot import save_plot

        if not any(r["status"] == "ok" for r in results):
            raise KernelHubError("nothing ran, so there is nothing to plot")
        save_plot(results, args.plot, title=f"kernel-hub bench on {chip.name if chip else '?'}")
        print(f"wrote {args.plot}")
    for failed in report.failed:
        print(
            f"error: {failed.op} {failed.case} {failed.implementation}: {failed.reason}",
            file=sys.stderr,
        )
    return 1 if report.failed else 0
