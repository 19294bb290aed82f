"""``kernel-hub mirror``: verified builds into a directory; ``kernel-hub serve``: serve it."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from kernel_hub.errors import KernelHubError
from kernel_hub.hub.lockfile import read_lock
from kernel_hub.hub.mirror import mirror_registry
from kernel_hub.hub.server import DEFAULT_MAX_REQUESTS, DEFAULT_MAX_UPLOAD, serve
from kernel_hub.registry.registry import load_registry

from .output import print_json, print_table

ENV_WRITE_TOKEN = "KERNEL_HUB_SERVE_WRITE_TOKEN"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "mirror", help="copy the verified hub builds the registry (or a lock) needs into DIR"
    )
    parser.add_argument("ops", nargs="*", metavar="OP", help="ops to mirror (default: all)")
    parser.add_argument("--to", type=Path, required=True, help="store directory to write")
    parser.add_argument("--registry", help="registry file (default: the in-tree registry.yaml)")
    parser.add_argument("--lock", type=Path, help="mirror exactly the builds this lock pins")
    parser.add_argument(
        "--trust-remote-code", action="store_true", help="mirror code from any publisher"
    )
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(func=run_mirror)

    parser = subparsers.add_parser(
        "serve", help="serve a store directory with the Hub's HTTP API (for HF_ENDPOINT)"
    )
    parser.add_argument("directory", type=Path, help="store directory ('kernel-hub mirror --to')")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8080, help="port (default 8080; 0: any free)")
    parser.add_argument(
        "--write-token",
        default=os.environ.get(ENV_WRITE_TOKEN) or None,
        help=f"accept writes (publish) carrying this token (default: ${ENV_WRITE_TOKEN}, which "
        "keeps it out of the process list; unset: read-only). Publishers set HF_TOKEN to it",
    )
    parser.add_argument(
        "--max-upload-mb",
        type=int,
        default=DEFAULT_MAX_UPLOAD >> 20,
        help=f"largest commit accepted, in MiB (default {DEFAULT_MAX_UPLOAD >> 20})",
    )
    parser.add_argument(
        "--max-requests",
        type=int,
        default=DEFAULT_MAX_REQUESTS,
        help=f"requests answered at once; more get 503 (default {DEFAULT_MAX_REQUESTS})",
    )
    parser.set_defaults(func=run_serve)


def run_mirror(args: argparse.Namespace) -> int:
    done, skipped = mirror_registry(
        load_registry(args.registry),
        args.to,
        args.ops or None,
        lock=read_lock(args.lock) if args.lock else None,
        trust_remote_code=args.trust_remote_code,
    )
    rows = [
        {
            "op": m.op,
            "repo": m.repo,
            "version": str(m.version),
            "commit": m.commit,
            "variants": list(m.variants),
            "refs": list(m.refs),
            "copied": m.copied,
        }
        for m in done
    ]
    if args.json:
        print_json({"to": str(args.to), "builds": rows, "skipped": skipped})
        return 0
    print_table(
        ["op", "repo", "version", "commit", "variants", "refs", "status"],
        [
            [
                r["op"],
                r["repo"],
                r["version"],
                r["commit"][:12],
                ",".join(r["variants"]),
                ",".join(r["refs"]),
                "copied" if r["copied"] else "already there",
            ]
            for r in rows
        ]
        + [[op, "-", "-", "-", "-", "-", f"skipped: {why}"] for op, why in skipped.items()],
    )
    print(f"verified and mirrored into {args.to}; serve it with 'kernel-hub serve {args.to}'")
    return 0


def run_serve(args: argparse.Namespace) -> int:
    if not args.directory.is_dir():
        raise KernelHubError(
            f"serve: {args.directory} is not a directory; make a store with 'kernel-hub mirror "
            f"--to {args.directory}', or 'mkdir {args.directory}' for an empty hub to publish to"
        )
    if args.max_upload_mb < 1 or args.max_requests < 1:
        raise KernelHubError("serve: --max-upload-mb and --max-requests must be at least 1")
    if args.write_token is not None and len(args.write_token) < 16:
        raise KernelHubError("serve: the write token needs at least 16 characters")
    server = serve(
        args.directory,
        args.host,
        args.port,
        write_token=args.write_token,
        max_upload=args.max_upload_mb << 20,
        max_requests=args.max_requests,
    )
    mode = "read-write (token required)" if args.write_token else "read-only"
    print(
        f"serving {args.directory} at {server.url} ({mode}; set HF_ENDPOINT={server.url})",
        flush=True,
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("stopped", file=sys.stderr)
    finally:
        server.server_close()
    return 0
