"""``kernel-hub new-kernel NAME``: a new kernel directory from the scaffold.

The scaffold is a complete kernel (manifest; package with reference, Pallas TPU kernel, JAX API
and implementation table, torch op, sharding rule, benchmark cases, ``KERNEL`` declaration; tests)
computing ``x * weight``: it passes its own tests, builds, compile-checks and loads as generated,
so a kernel author replaces the computation and keeps a working kernel at every step.
docs/writing-a-kernel.md walks through it. The templates ship in the wheel
(``new_kernel_template/``, ``string.Template`` placeholders).
"""

from __future__ import annotations

import argparse
import string
from pathlib import Path

from kernel_hub.errors import KernelHubError
from kernel_hub.hub.metadata import KERNEL_NAME
from kernel_hub.registry.registry import parse_registry

TEMPLATE_DIR = Path(__file__).parent / "new_kernel_template"
TEMPLATE_SUFFIX = ".tmpl"
RENAMED = {
    "package": "{package}",
    "kernel_tests": "tests",  # not "tests/" in the wheel, where only kernel tests would be
    "test_kernel.py.tmpl": "test_{package}.py.tmpl",
}


def names(kernel: str) -> dict[str, str]:
    """The template's placeholders for kernel ``kernel``: its package (and op) name is the
    kernel name with '-' as '_', as ``kernel-hub build`` requires."""
    if not KERNEL_NAME.match(kernel):
        raise KernelHubError(
            f"kernel name {kernel!r}: use lowercase letters, digits and '-', starting with a letter"
        )
    package = kernel.replace("-", "_")
    return {
        "kernel": kernel,
        "package": package,
        "op": package,
        "summary": "x * weight along the last axis (the kernel-hub scaffold, to be replaced)",
    }


def scaffold(kernel: str, directory: str | Path) -> Path:
    """Write kernel ``kernel`` into ``directory/kernel`` (which must not exist); its path."""
    values = names(kernel)
    target = Path(directory) / kernel
    if target.exists():
        raise KernelHubError(f"{target} already exists; choose another name or --dir")
    files = sorted(TEMPLATE_DIR.rglob(f"*{TEMPLATE_SUFFIX}"))
    if not files:
        raise KernelHubError(f"no scaffold templates under {TEMPLATE_DIR} (a broken install?)")
    for template in files:
        relative = template.relative_to(TEMPLATE_DIR)
        parts = [RENAMED.get(part, part).format(**values) for part in relative.parts]
        parts[-1] = parts[-1].removesuffix(TEMPLATE_SUFFIX)
        path = target.joinpath(*parts)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(string.Template(template.read_text()).substitute(values))
    return target


def registry_entry(kernel: str) -> str:
    """The ``registry.yaml`` entry (under ``ops:``) that makes the kernel's op loadable."""
    values = names(kernel)
    aliases = f"    aliases: [{values['op']}]\n" if values["op"] != kernel else ""
    return (
        f"  {kernel}:\n"
        f"    summary: {values['summary']}\n"
        f"{aliases}"
        f"    kernel: {kernel}\n"
        f"    repo: kernel-hub/{kernel}\n"
        f'    version: ">=1.0,<2"\n'
        f"    implementations:\n"
        f"      tpu: [pallas, xla]\n"
        f"      gpu: [xla]\n"
        f"      cpu: [xla, pallas]\n"
    )


def add_to_registry(registry: str | Path, kernel: str) -> None:
    """Append the kernel's entry to a registry whose ``ops:`` mapping comes last; the file is
    left unchanged when the result would not parse (the error says why)."""
    path = Path(registry)
    text = path.read_text()
    updated = text + ("" if text.endswith("\n") else "\n") + registry_entry(kernel)
    parse_registry(path, updated)
    path.write_text(updated)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "new-kernel",
        help="scaffold a new kernel directory",
        description=__doc__.split("\n\n")[1],
    )
    parser.add_argument("name", help="kernel name: lowercase letters, digits and '-'")
    parser.add_argument(
        "--dir", default="kernels", help="directory to create the kernel in (default: kernels)"
    )
    parser.add_argument(
        "--registry", help="also append the op's entry to this registry.yaml (its ops: last)"
    )
    parser.set_defaults(func=run_new_kernel)


def run_new_kernel(args: argparse.Namespace) -> int:
    path = scaffold(args.name, args.dir)
    if args.registry:
        add_to_registry(args.registry, args.name)
        added = f"added its entry to {args.registry}"
    else:
        added = "add this entry under ops: in registry.yaml:\n\n" + registry_entry(args.name)
    print(f"created {path}; {added}")
    print(
        f"\nnext: pytest {path}/tests; kernel-hub build {path}; "
        f"kernel-hub compile-check {args.name} --tpu v5e (see docs/writing-a-kernel.md)"
    )
    return 0
