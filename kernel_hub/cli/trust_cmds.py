"""``kernel-hub keygen``: a publisher's ed25519 signing key pair; ``kernel-hub index refresh /
revoke / show``: the publisher's signed, expiring index, and revoking a stolen key through it
(docs/trust.md, keys)."""

from __future__ import annotations

import argparse
import base64
from dataclasses import replace
from pathlib import Path

from kernel_hub.errors import KernelHubError
from kernel_hub.hub.index import DEFAULT_EXPIRY_DAYS, current_index, publish_index
from kernel_hub.hub.recovery import vet_listed
from kernel_hub.hub.signing import SigningKey, generate_key_pair
from kernel_hub.registry.publisher_keys import PublisherKeys, key_bytes, key_id
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
    parser.add_argument(
        "--pin",
        type=Path,
        metavar="REGISTRY",
        help="pin the public key for --publisher in this registry file (a publishers: section "
        "is added before its ops:; a registry that already has a publishers: section is refused)",
    )
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
    revoke = actions.add_parser(
        "revoke",
        help="revoke a stolen key: sign and upload the next index (with another pinned key, "
        "e.g. the backup) carrying the revocation; clients refuse the key from their next "
        "online fetch on",
    )
    revoke.add_argument(
        "key",
        metavar="KEY",
        help="the key to revoke: ed25519:BASE64, its .pub file, or the id of a key the registry "
        "pins for the publisher",
    )
    for sub in (refresh, revoke):
        sub.add_argument("--publisher", required=True, help="hub organisation")
        sub.add_argument(
            "--sign-key",
            type=Path,
            action="append",
            required=True,
            help="a pinned private key (repeat for a registry threshold); after a compromise, "
            "the backup key",
        )
        sub.add_argument(
            "--expires-days", type=float, default=DEFAULT_EXPIRY_DAYS, help="validity (default 7)"
        )
    show = actions.add_parser("show", help="fetch, verify and print the publisher's index")
    show.add_argument("--publisher", required=True, help="hub organisation")
    for sub in (refresh, revoke, show):
        sub.add_argument(
            "--registry",
            help="registry whose pinned keys verify the current index (default: "
            "the in-tree registry)",
        )
        sub.add_argument("--json", action="store_true", help="print JSON")
        sub.set_defaults(func=run_index)


def pinned_text(path: Path, text: str, publisher: str, public_key: str) -> str:
    """Registry ``text`` (of ``path``) with ``public_key`` pinned for ``publisher``: a
    ``publishers:`` section inserted before the top-level ``ops:`` line (which stays last, as
    ``new-kernel`` appends to it). Refused when the registry already has a ``publishers:``
    section; the result must parse and pin the key."""
    from kernel_hub.registry.registry import parse_registry

    lines = text.splitlines(keepends=True)
    if any(line.startswith("publishers:") for line in lines):
        raise KernelHubError(
            f"--pin {path}: it already has a publishers: section; add the key there by hand"
        )
    at = next((i for i, line in enumerate(lines) if line.startswith("ops:")), None)
    if at is None:
        raise KernelHubError(f"--pin {path}: no top-level 'ops:' line to pin the key before")
    section = f"publishers:\n  {publisher}:\n    keys: [{public_key}]\n"
    updated = "".join([*lines[:at], section, *lines[at:]])
    parse_registry(path, updated)
    return updated


def run_keygen(args: argparse.Namespace) -> int:
    if not args.out.parent.is_dir():
        raise KernelHubError(
            f"keygen --out {args.out}: directory {args.out.parent} does not exist; create it "
            "first (keys are written only where you chose)"
        )
    if args.pin is not None and not args.publisher:
        raise KernelHubError("keygen --pin needs --publisher: the org whose builds the key signs")
    original = args.pin.read_text() if args.pin is not None else None
    if original is not None:  # refused before a key is written: pinning a well-formed key works
        pinned_text(
            args.pin, original, args.publisher, "ed25519:" + base64.b64encode(bytes(32)).decode()
        )
    pair = generate_key_pair(args.out)
    publisher = args.publisher or "YOUR-ORG"
    if args.pin is not None:
        args.pin.write_text(pinned_text(args.pin, original, publisher, pair.public_key))
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
    if args.pin is not None:
        print(f"pinned for {publisher} in {args.pin}")
        return 0
    print("\npin it in registry.yaml:\n")
    print(f"publishers:\n  {publisher}:\n    keys: [{pair.public_key}]")
    return 0


def run_index(args: argparse.Namespace) -> int:
    registry = load_registry(args.registry)
    pinned = registry.publishers.get(args.publisher)
    if args.action == "show":
        if pinned is None or not pinned.keys:
            raise KernelHubError(f"the registry pins no key for publisher {args.publisher!r}")
        signed = current_index(args.publisher, pinned, online=True, what="kernel-hub index show")
    else:
        signers = [SigningKey(path) for path in args.sign_key]
        signing = tuple(k.public_key for k in signers)
        trusted = (
            replace(pinned, keys=tuple(dict.fromkeys((*pinned.keys, *signing))))
            if pinned is not None
            else PublisherKeys(args.publisher, signing)
        )
        revoke = (_public_key(args.key, trusted),) if args.action == "revoke" else ()
        signed = publish_index(
            args.publisher,
            signers,
            trusted,
            revoke=revoke,
            vet=vet_listed(registry.keys_for, f"kernel-hub index {args.action}"),
            expires_days=args.expires_days,
        )
    data = {
        "publisher": signed.publisher,
        "serial": signed.serial,
        "expires": signed.expires.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "kernels": {r: {str(v): c for v, c in vs.items()} for r, vs in signed.kernels.items()},
        "revoked": [key_id(k) for k in signed.revoked],
    }
    if args.json:
        print_json(data)
    else:
        print(f"{signed.describe()}")
        for repo, versions in data["kernels"].items():
            for version, commit in versions.items():
                print(f"  {repo} {version} {commit}")
        for key in data["revoked"]:
            print(f"  revoked {key}")
    return 0


def _public_key(text: str, keys: PublisherKeys) -> str:
    """``KEY`` of ``index revoke``: a public key, its .pub file, or a pinned key's id."""
    known = {key_id(k): k for k in (*keys.keys, *keys.revoked)}
    if text in known:
        return known[text]
    path = Path(text)
    candidate = path.read_text(encoding="ascii").strip() if path.is_file() else text
    try:
        key_bytes(candidate)
    except ValueError as exc:
        raise KernelHubError(
            f"index revoke {text}: not a key ({exc}); give ed25519:BASE64 (what 'kernel-hub "
            "keygen' prints), its .pub file, or the id of a key pinned for the publisher: "
            f"{', '.join(sorted(known)) or 'none pinned'}"
        ) from None
    return candidate
