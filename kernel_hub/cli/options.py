"""Argument helpers shared by command modules."""

from __future__ import annotations

import argparse
import importlib.util

from kernel_hub.errors import KernelHubError


def comma_list(text: str) -> list[str]:
    """'a,b, c' -> ['a', 'b', 'c'] (argparse type)."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
    return items


def ops_from_args(args: argparse.Namespace) -> list[str]:
    """The ops named on the command line, or every registry op with ``--all``."""
    if args.all and args.ops:
        raise KernelHubError("give op names or --all, not both")
    if args.all:
        from kernel_hub.registry.registry import load_registry

        return [entry.name for entry in load_registry(args.registry)]
    if not args.ops:
        raise KernelHubError("name at least one op (see 'kernel-hub list'), or pass --all")
    return list(args.ops)


def require_modules(*names: str) -> None:
    """Raise ``ModuleNotFoundError`` for the first of ``names`` not installed, before a command
    does any work; ``main`` turns it into the ``pip install 'kernel-hub[extra]'`` hint."""
    for name in names:
        if importlib.util.find_spec(name) is None:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
