"""Hub commands: ``build``, ``publish``, ``lock``, ``get OP``, ``versions OP``, ``verify OP``.

``keygen`` lives in :mod:`.trust_cmds`, ``mirror`` and ``serve`` in :mod:`.mirror_cmds`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kernel_hub.errors import HubError
from kernel_hub.hub import cache, settings
from kernel_hub.hub.build import build_kernel
from kernel_hub.hub.client import list_refs
from kernel_hub.hub.lockfile import find_lock
from kernel_hub.hub.locking import lock_registry
from kernel_hub.hub.publish import publish_kernel
from kernel_hub.loading.resolver import fetch_op_build, get_kernel, in_tree_dir
from kernel_hub.registry.publisher_keys import PublisherKeys
from kernel_hub.registry.registry import load_registry

from .output import print_json, print_table


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("build", help="build kernels/<name> into build/<variant>/")
    parser.add_argument(
        "kernel_dir",
        type=Path,
        help="kernel directory (holds kernel.yaml), or a registry op name (its in-tree kernel)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="output folder (default: <kernel_dir>/build; for an op name ./build/<kernel>)",
    )
    parser.add_argument("--variant", action="append", help="build only this variant (repeatable)")
    _json_flag(parser)
    parser.set_defaults(func=run_build)

    parser = subparsers.add_parser("publish", help="build, sign and upload a kernel as vX.Y.Z")
    parser.add_argument("kernel_dir", type=Path)
    parser.add_argument("--repo", required=True, help="hub repo, org/name")
    parser.add_argument(
        "--build-dir", type=Path, help="where to build (default: <kernel_dir>/build)"
    )
    signing = parser.add_mutually_exclusive_group(required=True)
    signing.add_argument(
        "--sign-key",
        type=Path,
        action="append",
        help="private key from 'kernel-hub keygen' to sign each variant (repeat for a threshold)",
    )
    signing.add_argument(
        "--unsigned",
        action="store_true",
        help="publish without a signature (kernel-hub refuses to load such builds)",
    )
    parser.add_argument(
        "--index",
        action="store_true",
        help="also add the version to the publisher's signed index ('kernel-hub index')",
    )
    parser.add_argument("--registry", help="registry whose keys verify the current index")
    _json_flag(parser)
    parser.set_defaults(func=run_publish)

    parser = subparsers.add_parser("lock", help="pin every hub op of the registry in a lock file")
    parser.add_argument("--registry", help="registry file (default: the in-tree registry.yaml)")
    parser.add_argument("--output", type=Path, default=Path(settings.LOCK_FILE_NAME))
    parser.add_argument("--op", action="append", help="lock only this op (repeatable)")
    _json_flag(parser)
    parser.set_defaults(func=run_lock)

    for name, func, text in (
        ("get", run_get, "load an op's kernel as get_kernel does and say where it came from"),
        ("verify", run_verify, "fetch an op's hub build, check its signature and digests only"),
    ):
        parser = subparsers.add_parser(name, help=text)
        parser.add_argument("op")
        _selection_args(parser, with_source=name == "get")
        _json_flag(parser)
        parser.set_defaults(func=func)

    parser = subparsers.add_parser("versions", help="list the published versions of an op")
    parser.add_argument("op")
    parser.add_argument("--registry")
    _json_flag(parser)
    parser.set_defaults(func=run_versions)


def _json_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON")


def _selection_args(parser: argparse.ArgumentParser, *, with_source: bool) -> None:
    parser.add_argument("--registry")
    if with_source:
        parser.add_argument("--source", choices=settings.SOURCES)
    pick = parser.add_mutually_exclusive_group()
    pick.add_argument("--version", help="version range, e.g. '>=1.2,<2' (overrides the registry)")
    pick.add_argument("--revision", help="hub branch, tag or commit (overrides the registry)")
    locks = parser.add_mutually_exclusive_group()
    locks.add_argument(
        "--lock", type=Path, help="lock file (default: ./kernel-hub.lock if present)"
    )
    locks.add_argument("--no-lock", action="store_true", help="ignore lock files")
    parser.add_argument("--variant", help="build variant (default: the one for this machine)")
    parser.add_argument(
        "--trust-remote-code", action="store_true", help="import code from any publisher"
    )


def _lock_arg(args: argparse.Namespace) -> Path | bool | None:
    return False if args.no_lock else args.lock


def run_build(args: argparse.Namespace) -> int:
    kernel_dir, out = args.kernel_dir, args.out
    if not kernel_dir.exists() and len(kernel_dir.parts) == 1:
        # an op name: its in-tree kernel, built into the current directory (never into an
        # installed package's directory)
        kernel_dir = in_tree_dir(load_registry().get(str(kernel_dir)))
        out = out or Path("build") / kernel_dir.name
    build = build_kernel(kernel_dir, out, args.variant)
    rows = [
        {
            "variant": name,
            "path": str(build.path / name),
            "version": meta["kernel-hub"]["version"],
            "backend": meta["backend"]["type"],
            "files": len(meta["digest"]["files"]) + 1,
        }
        for name, meta in build.variants.items()
    ]
    if args.json:
        print_json({"kernel": build.manifest.name, "path": str(build.path), "variants": rows})
    else:
        print_table(
            ["variant", "version", "backend", "files", "path"],
            [[r["variant"], r["version"], r["backend"], r["files"], r["path"]] for r in rows],
        )
    return 0


def run_publish(args: argparse.Namespace) -> int:
    index = None
    if args.index:
        org = args.repo.split("/", 1)[0]
        index = load_registry(args.registry).publishers.get(org) or PublisherKeys(org, ())
    published = publish_kernel(
        args.kernel_dir, args.repo, sign_key=args.sign_key, build_dir=args.build_dir, index=index
    )
    data = {
        "repo": published.repo,
        "version": str(published.version),
        "commit": published.commit,
        "tag": published.tag,
        "branch": published.branch,
        "variants": sorted(published.build.variants),
        "signed_by": published.signed_by,
    }
    if args.json:
        print_json(data)
    else:
        moved = f", branch {published.branch} moved" if published.branch else ""
        signed = f"signed by {published.signed_by}" if published.signed_by else "UNSIGNED"
        print(f"published {published.repo} {published.tag} at {published.commit}{moved}; {signed}")
    return 0


def run_lock(args: argparse.Namespace) -> int:
    result = lock_registry(load_registry(args.registry), args.output, args.op)
    data = {
        "path": str(result.lock.path),
        "ops": {op: pin.to_json() for op, pin in result.lock.ops.items()},
        "skipped": result.skipped,
    }
    if args.json:
        print_json(data)
        return 0
    print_table(
        ["op", "repo", "version", "commit", "variants"],
        [
            [op, p.repo, p.version, p.commit[:12], ",".join(sorted(p.variants))]
            for op, p in result.lock.ops.items()
        ]
        + [[op, "-", "-", "-", f"skipped: {why}"] for op, why in result.skipped.items()],
    )
    print(f"wrote {result.lock.path}")
    return 0


def run_get(args: argparse.Namespace) -> int:
    module = get_kernel(
        args.op,
        registry=args.registry,
        source=args.source,
        version=args.version,
        revision=args.revision,
        lock=_lock_arg(args),
        variant=args.variant,
        trust_remote_code=args.trust_remote_code,
    )
    origin = module.origin
    data = {
        "op": args.op,
        "kernel": module.manifest.name,
        "version": str(module.manifest.version),
        "source": origin.source,
        "path": str(origin.path),
        "repo": origin.repo,
        "commit": origin.commit,
        "variant": origin.variant,
        "module": module.__name__,
        "ops": list(module.manifest.ops),
        "layers": list(module.manifest.layers),
    }
    _print_mapping(data, args.json)
    return 0


def run_verify(args: argparse.Namespace) -> int:
    registry = load_registry(args.registry)
    entry = registry.get(args.op)
    lock_file = find_lock(_lock_arg(args))
    build = fetch_op_build(
        entry,
        version=args.version,
        revision=args.revision,
        lock_file=lock_file,
        variant=args.variant,
        trust_remote_code=args.trust_remote_code,
        keys=registry.keys_for(entry.repo) if entry.repo else None,
    )
    locked = lock_file is not None and entry.name in lock_file.ops
    data = {
        "op": entry.name,
        "ok": True,
        "repo": build.repo,
        "version": str(build.version),
        "commit": build.commit,
        "variant": build.variant,
        "path": str(build.path),
        "files_checked": len(build.metadata.digest) + 1,
        "signed_by": build.signed_by,
        "checked_against": [
            "signature by a pinned key",
            "signed metadata digest",
            *(["lock file"] if locked else []),
        ],
    }
    _print_mapping(data, args.json)
    return 0


def run_versions(args: argparse.Namespace) -> int:
    entry = load_registry(args.registry).get(args.op)
    if entry.repo is None:
        raise HubError(f"op {entry.name} has no hub repo in the registry")
    cached = cache.cached_versions(entry.repo)
    if settings.offline():
        versions, where = cached, "cache"
    else:
        versions, where = list_refs(entry.repo)[0], "hub"
    rows = [
        {
            "version": str(v),
            "commit": commit,
            "in_registry_range": entry.version.contains(v, prereleases=True),
            "cached": v in cached and cached[v] == commit,
        }
        for v, commit in sorted(versions.items(), reverse=True)
    ]
    if args.json:
        print_json({"op": entry.name, "repo": entry.repo, "source": where, "versions": rows})
        return 0
    if not rows:
        hint = (
            "nothing cached (HF_HUB_OFFLINE is set): fetch a build online first, e.g. "
            f"'kernel-hub get {entry.name} --version \"{entry.version}\"'"
            if where == "cache"
            else f"nothing published in {entry.repo}"
        )
        print(f"{entry.repo} ({where}): {hint}")
        return 0
    print(f"{entry.repo} ({where}); registry range {entry.version}")
    print_table(
        ["version", "commit", "in range", "cached"],
        [
            [
                r["version"],
                r["commit"][:12],
                "yes" if r["in_registry_range"] else "no",
                "yes" if r["cached"] else "no",
            ]
            for r in rows
        ],
    )
    return 0


def _print_mapping(data: dict, as_json: bool) -> None:
    if as_json:
        print_json(data)
        return
    width = max(map(len, data))
    for key, value in data.items():
        if value is not None:
            shown = ", ".join(map(str, value)) if isinstance(value, list) else value
            print(f"{key.ljust(width)}  {shown}")
