"""``kernel-hub list``: the ops of the registry and what would run here."""

from __future__ import annotations

import argparse

from kernel_hub.loading.resolver import in_tree_dir
from kernel_hub.platform import host_platform
from kernel_hub.registry.manifest import load_manifest
from kernel_hub.registry.registry import load_registry

from .output import print_json, print_table


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("list", help="list the registry's ops")
    parser.add_argument("--registry", help="registry file (default: the in-tree registry.yaml)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(func=run_list)


def list_ops(registry_path: str | None = None) -> list[dict]:
    registry = load_registry(registry_path)
    platform = host_platform()
    rows = []
    for entry in registry:
        manifest = load_manifest(in_tree_dir(entry))
        available = manifest.implementations_on(platform)
        order = [name for name in entry.implementations_for(platform) if name in available]
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
