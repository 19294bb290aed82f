"""``kernel-hub compile-check``: compile kernels for TPU generations without a TPU."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .options import comma_list, ops_from_args
from .output import print_table

_DIRECTIONS = {"forward": ("forward",), "backward": ("backward",), "both": ("forward", "backward")}


def register(subparsers: argparse._SubParsersAction) -> None:
    from kernel_hub.topologies import DEFAULT_GENERATIONS

    parser = subparsers.add_parser(
        "compile-check",
        help="compile kernels for TPU generations (no TPU needed)",
        description="Compile every TPU implementation (Pallas, Tokamax Mosaic) of the ops at "
        "their benchmark cases, forward and backward, for each TPU generation with libtpu's "
        "deviceless topologies. Exit code 1 if any cell fails.",
    )
    parser.add_argument("ops", nargs="*", metavar="OP", help="registry op name(s)")
    parser.add_argument("--all", action="store_true", help="every op of the registry")
    parser.add_argument(
        "--tpu",
        type=comma_list,
        default=list(DEFAULT_GENERATIONS),
        help=f"generations (default: {','.join(DEFAULT_GENERATIONS)})",
    )
    parser.add_argument("--shapes", type=comma_list, help="case names or fnmatch patterns")
    parser.add_argument("--direction", choices=tuple(_DIRECTIONS), default="both")
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="compile in this many worker processes (0: one per CPU; default 1, in process)",
    )
    parser.add_argument(
        "--mesh",
        action="store_true",
        help="compile the kernels' sharded cases on every chip of each topology and check the "
        "collectives in the program, plus a negative control per case "
        "(docs/running-on-a-pod.md)",
    )
    parser.add_argument("--json", metavar="PATH", help="write every cell with its messages")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.add_argument("--registry", help="registry file (default: the in-tree registry.yaml)")
    parser.set_defaults(func=run_compile_check)


def run_compile_check(args: argparse.Namespace) -> int:
    if args.mesh:
        return _run_mesh_check(args)
    from kernel_hub.bench.compile_check import check_generations, matrix_record, plan_kernel
    from kernel_hub.bench.compile_pool import run_tasks
    from kernel_hub.bench.provenance import command_line
    from kernel_hub.bench.report import compile_failures, compile_table
    from kernel_hub.progress import progress_bar

    generations = check_generations(args.tpu)
    tasks = [
        task
        for op in ops_from_args(args)
        for task in plan_kernel(
            op,
            generations,
            patterns=args.shapes,
            directions=_DIRECTIONS[args.direction],
            registry=args.registry,
        )
    ]
    bar = progress_bar(len(tasks), enabled=not args.no_progress)

    def advance(task, result) -> None:
        bar.set_description(str(task))
        bar.update()

    try:
        results = [r.to_json() for r in run_tasks(tasks, args.jobs, advance)]
    finally:
        bar.close()

    print_table(*compile_table(results))
    failures = compile_failures(results)
    passed = sum(r["status"] == "pass" for r in results)
    skipped = sum(r["status"] == "skip" for r in results)
    cpu = sum(r["cpu_seconds"] for r in results)
    print(
        f"\n{len(results)} cells: {passed} pass, {len(failures)} fail, {skipped} skipped; "
        f"{cpu:.0f} CPU-s compiling"
    )
    for failure in failures:
        print(f"FAIL {failure}")
    if args.json:
        record = matrix_record(results, generations, command_line("kernel-hub", args.argv))
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 1 if failures else 0


def _run_mesh_check(args: argparse.Namespace) -> int:
    from kernel_hub.bench.mesh_compile import mesh_matrix
    from kernel_hub.bench.overflow import MemoryOverflow

    results = [
        r.to_json()
        for r in mesh_matrix(
            ops_from_args(args),
            args.tpu,
            directions=_DIRECTIONS[args.direction],
            registry=args.registry,
        )
    ]
    headers = [
        "kernel",
        "case",
        "direction",
        "generation",
        "mesh",
        "kind",
        "status",
        "s",
        "collectives",
    ]
    rows = [
        [
            r["kernel"],
            r["case"],
            r["direction"],
            r["generation"],
            r["mesh"],
            r["kind"],
            r["status"],
            f"{r['seconds']:.1f}",
            ", ".join(f"{k} {v}" for k, v in sorted(r["collectives"].items())),
        ]
        for r in results
    ]
    print_table(headers, rows)
    failures = [r for r in results if r["status"] == "fail"]
    print(f"\n{len(results)} cells: {len(results) - len(failures)} pass, {len(failures)} fail")
    for r in failures:
        cell = f"{r['kernel']} {r['case']} {r['direction']} {r['kind']} {r['generation']}"
        label = f" ({MemoryOverflow(**r['overflow'])})" if r.get("overflow") else ""
        print(f"FAIL{label} {cell}: {r['error']}")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"schema": 1, "kind": "mesh-compile", "results": results}, indent=1) + "\n"
        )
        print(f"wrote {args.json}")
    return 1 if failures else 0
