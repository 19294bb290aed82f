"""``kernel-hub demo``: kernelize tiny models with every registry kernel and compare with stock."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
from collections import Counter
from typing import Any

from kernel_hub.errors import KernelHubError

from . import demo_hub
from .options import require_modules
from .output import print_json, print_table, print_wrapped

CPU_TIMING_NOTE = (
    "What the times tell: the models are tiny and run on the CPU, where each kernel call "
    "crosses the torch-JAX bridge (about 50 us a call) and runs the kernel's XLA "
    "implementation (its Pallas code targets TPUs), so kernelized is expected to be slower "
    "here: these times measure bridging overhead, not TPU speed. What the demo checks is "
    "exactness: the kernelized model's logits and greedy tokens against stock, and that "
    "unkernelize restores the stock model."
)


def register(subparsers: argparse._SubParsersAction) -> None:
    from kernel_hub.models.tiny import CAUSAL_LM_MODELS, DEFAULT_MODELS

    parser = subparsers.add_parser(
        "demo", help="kernelize tiny Llama/Mixtral models and compare them with stock"
    )
    parser.add_argument(
        "--model",
        action="append",
        choices=sorted(CAUSAL_LM_MODELS),
        help=f"model to run (repeatable; default: {', '.join(DEFAULT_MODELS)})",
    )
    parser.add_argument("--registry", help="registry file (default: the in-tree registry.yaml)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads while timing (default 1: torch's and XLA's thread pools "
        "contend on small CPUs; 0 keeps torch's default)",
    )
    parser.add_argument(
        "--no-hub",
        action="store_true",
        help="skip the hub round trip (publish signed builds to a local kernel-hub serve, fetch, "
        "verify, kernelize with them)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON (with full reports)")
    parser.set_defaults(func=run_demo_command)


def _swapped_cell(row: dict[str, Any]) -> str:
    return ", ".join(f"{target} x{n}" for target, n in row["swapped"].items()) or "nothing"


def _print_rows(rows: list[dict[str, Any]]) -> None:
    done = [r for r in rows if "error" not in r]
    print(f"torch threads: {rows[0]['torch_threads']}; forward times are medians, in ms\n")
    print_table(
        [
            "model",
            "builds",
            "swapped",
            "left alone",
            "max |dlogit|",
            "greedy same",
            "stock ms",
            "kernelized ms",
            "unkernelize exact",
            "ok",
        ],
        [
            [
                r["model"],
                r["builds"],
                _swapped_cell(r),
                r["left_alone"],
                f"{r['max_logit_diff']:.2e}",
                "yes" if r["greedy_identical"] else "NO",
                f"{r['stock_ms']:.2f}",
                f"{r['kernelized_ms']:.2f}",
                "yes" if r["unkernelize_restores"] else "NO",
                "ok" if r["ok"] else "FAIL",
            ]
            for r in done
        ],
    )
    reasons = Counter(
        (r["model"], e["cls"], e["reason"])
        for r in done
        for e in r["report"]["entries"]
        if e["reason"]
    )
    if reasons:
        print("\nleft alone:")
        for (model, cls, reason), count in reasons.items():
            print_wrapped(f"{model}: {count} x {cls}: {reason}", indent="  ")
    for r in rows:
        if "error" in r:
            print(f"\n{r['model']}: error: {r['error']}")


def run_demo_command(args: argparse.Namespace) -> int:
    require_modules("transformers")
    from kernel_hub.models.demo import run_demo
    from kernel_hub.models.tiny import DEFAULT_MODELS

    if args.threads < 0:
        raise KernelHubError(f"--threads must be 0 (torch's default) or more, got {args.threads}")

    def progress(line: str) -> None:
        if not args.json:
            print(f"demo: {line}", file=sys.stderr, flush=True)

    models = args.model or list(DEFAULT_MODELS)
    threads = args.threads or None
    skip_hub = (
        "--no-hub"
        if args.no_hub
        else "--registry (the round trip publishes the built-in kernels)"
        if args.registry
        else demo_hub.missing_extra()
    )
    if skip_hub and not args.no_hub:
        progress(f"hub round trip skipped: {skip_hub}")
    with contextlib.ExitStack() as stack:
        # entered first: huggingface_hub must see the local endpoint when it is first imported
        hub = None if skip_hub else stack.enter_context(demo_hub.local_hub())
        rows = run_demo(models, registry=args.registry, threads=threads, progress=progress)
        if hub is not None:
            hub = demo_hub.publish_and_fetch(hub, progress)
            rows += demo_hub.hub_rows(hub, models, threads, progress)
    builds = [dataclasses.asdict(b) for b in hub.builds] if hub is not None else []
    if args.json:
        print_json(
            {"rows": rows, "hub_builds": builds, "not_published": dict(hub.not_published)}
            if hub is not None
            else rows
        )
    else:
        _print_rows(rows)
        if builds:
            print(f"\nhub builds (published, fetched, verified, loaded; local hub {hub.url}):")
            print_table(
                ["op", "repo", "version", "commit", "variant", "signed by"],
                [
                    [
                        b["op"],
                        b["repo"],
                        b["version"],
                        b["commit"][:12],
                        b["variant"],
                        b["signed_by"],
                    ]
                    for b in builds
                ],
            )
        for op, why in hub.not_published if hub is not None else ():
            print(f"not published, ran in-tree: {op}: {why}")
        print()
        print_wrapped(CPU_TIMING_NOTE)
    return 0 if all(r["ok"] for r in rows) else 1
