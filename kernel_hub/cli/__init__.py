"""``kernel-hub`` command line. Each command group lives in its own module with a ``register``."""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
from collections.abc import Sequence

from kernel_hub.errors import KernelHubError
from kernel_hub.platform import accelerator_present
from kernel_hub.version import __version__

# Modules under kernel_hub.cli, each with ``register(subparsers)``; a command sets ``func``.
COMMAND_MODULES = (
    "registry_cmds",
    "hub_cmds",
    "trust_cmds",
    "mirror_cmds",
    "demo_cmds",
    "models_cmds",
    "tiny_cmds",
    "bench_cmds",
    "model_bench_cmds",
    "compile_cmds",
    "doctor_cmds",
    "new_kernel",
)

EXTRA_OF_MODULE = {
    "transformers": "transformers",
    "tokamax": "tokamax",
    "huggingface_hub": "hub",
    "cryptography": "hub",
    "matplotlib": "bench",
    "libtpu": "tpu",
    "diffusers": "diffusers",
    "accelerate": "trainer",
    "torchax": "torchax",
    "torch_tpu": "torch-tpu",
}
"""Import name -> the kernel-hub extra (pyproject.toml) that installs it."""

_CLI_TERMS = (
    (re.compile(r" or trust_remote_code=\[[^\]]*\]"), ""),  # the flag has no per-repo form
    (re.compile(r"trust_remote_code=True"), "--trust-remote-code"),
    (re.compile(r"lock=False"), "--no-lock"),
    (re.compile(r"\bversion= or revision="), "--version or --revision"),
)
"""Library keyword arguments in error messages -> the command line's flags for them."""


def in_cli_terms(message: str) -> str:
    """An error raised for library callers, reworded for the command line's flags."""
    for pattern, flag in _CLI_TERMS:
        message = pattern.sub(flag, message)
    return message


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kernel-hub", description="Pallas and Tokamax kernels for PyTorch users."
    )
    parser.add_argument("--version", action="version", version=f"kernel-hub {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(f".{name}", __name__).register(subparsers)
    return parser


def _quiet_jax_start() -> None:
    """On a host without an accelerator JAX runs on its CPU backend; saying so up front keeps
    libtpu (installed with ``kernel-hub[tpu]``) from printing its failed TPU search. Deviceless
    TPU compiles (``compile-check``) do not need the TPU backend. ``JAX_PLATFORMS`` wins."""
    if "JAX_PLATFORMS" not in os.environ and not accelerator_present():
        os.environ["JAX_PLATFORMS"] = "cpu"


def main(argv: Sequence[str] | None = None) -> int:
    _quiet_jax_start()
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # recorded in result files
    try:
        return int(args.func(args) or 0)
    except KernelHubError as exc:
        print(f"kernel-hub: error: {in_cli_terms(str(exc))}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        extra = EXTRA_OF_MODULE.get((exc.name or "").partition(".")[0])
        if extra is None:
            raise
        print(
            f"kernel-hub: error: {args.command} needs the {exc.name!r} package, which is not "
            f"installed: pip install 'kernel-hub[{extra}]'",
            file=sys.stderr,
        )
        return 2
