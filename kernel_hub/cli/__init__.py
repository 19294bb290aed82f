"""``kernel-hub`` command line. Each command group lives in its own module with a ``register``."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from kernel_hub.errors import KernelHubError

# Modules under kernel_hub.cli, each with ``register(subparsers)``; a command sets ``func``.
COMMAND_MODULES = (
    "registry_cmds",
    "hub_cmds",
    "trust_cmds",
    "mirror_cmds",
    "demo_cmds",
    "models_cmds",
    "bench_cmds",
    "compile_cmds",
    "new_kernel",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kernel-hub", description="Pallas and Tokamax kernels for PyTorch users."
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(f".{name}", __name__).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # recorded in result files
    try:
        return int(args.func(args) or 0)
    except KernelHubError as exc:
        print(f"kernel-hub: error: {exc}", file=sys.stderr)
        return 2
