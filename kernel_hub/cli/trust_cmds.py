"""``kernel-hub keygen``: a publisher's ed25519 signing key pair; ``kernel-hub index refresh /
show``: the publisher's signed, expiring index (docs/trust.md, key rotation)."""

from __future__ import annotations

import argparse
from pathlib import Path

from kernel_hub.errors import KernelHubError
from kernel_hub.hub.index import DEFAULT_EXPIRY_DAYS, current_index, publish_index
from kernel_hub.hub.signing import SigningKey, generate_key_pair
from kernel_hub.registry.publisher_keys import PublisherKeys
from kernel_hub.registry.registry import load_registry

from .output import print_json


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "keygen", help="make an ed25519 key pair for signing published builds"
    )
    parser.add_argument(
        "--out",
        type=Path,
        required=True,
        help="private key file to write (mode 0600); the public key goes to OUT.pub",
    )
    parser.add_argument("--publisher", help="org to show in the registry snippet")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(func=run_keygen)

    index = subparsers.add_parser(
        "index", help="the publisher's signed, expiring index of versions (freshness)"
    )
    actions = index.add_subparsers(dest="action", required=True, metavar="ACTION")
    refresh = actions.add_parser(
        "refresh",
        help="sign and upload the next index (new serial and expiry); run it before it expires, "
        "and with a new key after a rotation",
    )
    refresh.add_argument("--publisher", required=True, help="hub organisation")
    refresh.add_argument(
        "--sign-key",
        type=Path,
        action="append",
        required=True,
        help="a pinned private key (repeat for a registry threshold)",
    )
    refresh.add_argument(
        "--expires-days", type=float, default=DEFAULT_EXPIRY_DAYS, help="validity (default 7)"
    )
    show = actions.add_parser("show", help="fetch, verify and print the publisher's index")
    show.add_argument("--publisher", required=True, help="hub organisation")
    for sub in (refresh, show):
        sub.add_argument(
            "--registry",
            help="registry whose pinned keys verify the current index (default: "
            "the in-tree registry)",
        )
        sub.add_argument("--json", action="store_true", help="print JSON")
        sub.set_defaults(func=run_index)


def run_keygen(args: argparse.Namespace) -> int:
    if not args.out.parent.is_dir():
        raise KernelHubError(
            f"keygen --out {args.out}: directory {args.out.parent} does not exist; create it "
            "first (keys are written only where you chose)"
        )
    pair = generate_key_pair(args.out)
    publisher = args.publisher or "YOUR-ORG"
    if args.json:
        print_json(
            {
                "private_key": str(pair.private_path),
                "public_key_file": str(pair.public_path),
                "public_key": pair.public_key,
                "key_id": pair.key_id,
            }
        )
        return 0
    print(f"private key  {pair.private_path}  (keep it secret: whoever holds it can publish)")
    print(f"public key   {pair.public_path}  id {pair.key_id}")
    print("\npin it in registry.yaml:\n")
    print(f"publishers:\n  {publisher}:\n    keys: [{pair.public_key}]")
    return 0


def run_index(args: argparse.Namespace) -> int:
    registry = load_registry(args.registry)
    pinned = registry.publishers.get(args.publisher)
    if args.action == "refresh":
        signers = [SigningKey(path) for path in args.sign_key]
        trusted = PublisherKeys(
            args.publisher,
            (*(pinned.keys if pinned else ()), *(k.public_key for k in signers)),
            pinned.revoked if pinned else (),
            threshold=pinned.threshold if pinned else 1,
        )
        signed = publish_index(args.publisher, signers, trusted, expires_days=args.expires_days)
    else:
        if pinned is None or not pinned.keys:
            raise KernelHubError(f"the registry pins no key for publisher {args.publisher!r}")
        signed = current_index(args.publisher, pinned, online=True, what="kernel-hub index show")
    data = {
        "publisher": signed.publisher,
        "serial": signed.serial,
        "expires": signed.expires.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "kernels": {r: {str(v): c for v, c in vs.items()} for r, vs in signed.kernels.items()},
    }
    if args.json:
        print_json(data)
    else:
        print(f"{signed.describe()}")
        for repo, versions in data["kernels"].items():
            for version, commit in versions.items():
                print(f"  {repo} {version} {commit}")
    return 0
