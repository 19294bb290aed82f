"""``kernel-hub list``: the ops of the registry and what would run here.

The order comes from the registry's ``implementations`` override when it has one (read with the
kernel's manifest, no JAX import); otherwise from the kernel's own implementation tables, which
means importing that kernel (and so JAX).
"""

from __future__ import annotations

import argparse

from kernel_hub.loading.resolver import get_kernel, in_tree_dir
from kernel_hub.platform import Platform, host_platform
from kernel_hub.registry.manifest import load_manifest
from kernel_hub.registry.registry import OpEntry, Registry, load_registry

from .output import print_json, print_table


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("list", help="list the registry's ops")
    parser.add_argument("--registry", help="registry file (default: the in-tree registry.yaml)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(func=run_list)


def _kernel_order(entry: OpEntry, registry: Registry, platform: Platform) -> list[str]:
    """The order the kernel's implementation tables state on ``platform`` (imports the kernel)."""
    order: list[str] = []
    for table in get_kernel(entry.name, registry=registry.path).KERNEL.implementation_tables:
        order += [name for name in table.order(platform) if name not in order]
    return order


def list_ops(registry_path: str | None = None) -> list[dict]:
    registry = load_registry(registry_path)
    platform = host_platform()
    rows = []
    for entry in registry:
        manifest = load_manifest(in_tree_dir(entry))
        available = manifest.implementations_on(platform)
        stated = (
            entry.implementations_for(platform)
            if entry.overrides_order
            else _kernel_order(entry, registry, platform)
            if available
            else ()
        )
        order = [name for name in stated if name in available]
        rows.append(
            {
                "op": entry.name,
                "aliases": list(entry.aliases),
                "kernel": entry.kernel,
                "version_range": str(entry.version),
                "in_tree_version": str(manifest.version),
                "repo": entry.repo,
                "layers": list(entry.layers),
                "platform": platform,
                "implementations": order,
                "would_run": order[0] if order else None,
            }
        )
    return rows


def run_list(args: argparse.Namespace) -> int:
    rows = list_ops(args.registry)
    if args.json:
        print_json(rows)
        return 0
    print_table(
        [
            "op",
            "version",
            "in-tree",
            f"order on {rows[0]['platform'] if rows else '?'}",
            "runs",
            "layers",
        ],
        [
            [
                r["op"],
                r["version_range"],
                r["in_tree_version"],
                ",".join(r["implementations"]),
                r["would_run"] or "-",
                ",".join(r["layers"]) or "-",
            ]
            for r in rows
        ],
    )
    return 0
