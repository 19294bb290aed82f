"""``kernel-hub keygen``: a publisher's ed25519 signing key pair."""

from __future__ import annotations

import argparse
from pathlib import Path

from kernel_hub.errors import KernelHubError
from kernel_hub.hub.signing import generate_key_pair

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
