"""``kernel-hub demo``: kernelize tiny models with every registry kernel and compare with stock."""

from __future__ import annotations

import argparse
from collections import Counter
from typing import Any

from kernel_hub.errors import KernelHubError

from .output import print_json, print_table


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
            print(f"  {model}: {count} x {cls}: {reason}")
    for r in rows:
        if "error" in r:
            print(f"\n{r['model']}: error: {r['error']}")


def run_demo_command(args: argparse.Namespace) -> int:
    from kernel_hub.models.demo import run_demo
    from kernel_hub.models.tiny import DEFAULT_MODELS

    if args.threads < 0:
        raise KernelHubError(f"--threads must be 0 (torch's default) or more, got {args.threads}")
    rows = run_demo(
        args.model or DEFAULT_MODELS, registry=args.registry, threads=args.threads or None
    )
    if args.json:
        print_json(rows)
    else:
        _print_rows(rows)
    return 0 if all(r["ok"] for r in rows) else 1
