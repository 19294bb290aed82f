"""ed25519 signatures over a build variant's ``metadata.json``, checked against pinned keys.

``metadata.json`` lists every other file's sha256, the version and the variant, so a valid
signature over it covers the whole variant. The signature of ``build/<variant>/`` is the repo
file ``signatures/<variant>.sig`` (outside the variant folder, whose every file Hugging Face
``kernels`` digests):

    {"kernel-hub-signature": 1,
     "signed": {"repo": "org/name", "version": "1.0.0", "variant": "torch-cpu",
                "metadata": "<base64 sha256 of metadata.json>"},
     "key": "ed25519:<16 hex>", "signature": "<base64>"}

The signed statement names the repo too, so a build signed for one repo cannot be served as
another's; the client rebuilds the statement from what it asked for and what it downloaded, and
verifies the signature over that, never over the statement the server sent. Keys come from the
registry (:mod:`kernel_hub.registry.publisher_keys`), the trust anchor the client already holds.

The cryptography is the ``cryptography`` package's (OpenSSL's ed25519); nothing here is hand-made.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kernel_hub.errors import IntegrityError, KernelHubError, SourceError
from kernel_hub.registry.publisher_keys import PublisherKeys, key_bytes, key_id, key_text

from .json_source import field_line, load_json

SIGNATURE_DIR = "signatures"
SIGNATURE_FORMAT = 1
_FIELDS = {"kernel-hub-signature", "signed", "key", "signature", "cosignatures"}
_SIGNED_FIELDS = {"repo", "version", "variant", "metadata"}


def _crypto():
    try:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError:  # pragma: no cover - the 'hub' extra installs it
        raise KernelHubError(
            "signed kernel builds need the 'cryptography' package: pip install 'kernel-hub[hub]'"
        ) from None
    return ed25519, serialization


@dataclass(frozen=True)
class KeyPair:
    private_path: Path
    public_path: Path
    public_key: str
    """``ed25519:BASE64``, the line to pin in registry.yaml."""

    @property
    def key_id(self) -> str:
        return key_id(self.public_key)


def generate_key_pair(private_path: str | Path) -> KeyPair:
    """A new key: the private key (PKCS#8 PEM, mode 0600) at ``private_path``, the public key at
    ``private_path.pub``. Existing files are never overwritten."""
    ed25519, serialization = _crypto()
    private_path = Path(private_path)
    public_path = private_path.with_name(private_path.name + ".pub")
    for path in (private_path, public_path):
        if path.exists():
            raise KernelHubError(f"{path} already exists; refusing to overwrite a key")
    key = ed25519.Ed25519PrivateKey.generate()
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    public = key_text(
        key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    )
    private_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    public_path.write_text(public + "\n", encoding="ascii")
    return KeyPair(private_path, public_path, public)


class SigningKey:
    """A private key read from a ``kernel-hub keygen`` file."""

    def __init__(self, path: str | Path):
        ed25519, serialization = _crypto()
        self.path = Path(path)
        try:
            key = serialization.load_pem_private_key(self.path.read_bytes(), password=None)
        except FileNotFoundError:
            raise KernelHubError(f"signing key {self.path} not found") from None
        except (ValueError, TypeError) as exc:
            raise KernelHubError(
                f"{self.path} is not an unencrypted PEM private key ({exc})"
            ) from None
        if not isinstance(key, ed25519.Ed25519PrivateKey):
            raise KernelHubError(f"{self.path} holds a {type(key).__name__}, not an ed25519 key")
        self._key = key
        self.public_key = key_text(
            key.public_key().public_bytes(
                serialization.Encoding.Raw, serialization.PublicFormat.Raw
            )
        )

    def sign_statement(self, signed: dict[str, str]) -> tuple[str, str]:
        """(key id, base64 signature) over the canonical form of ``signed``."""
        signature = self._key.sign(_canonical(signed))
        return key_id(self.public_key), base64.b64encode(signature).decode("ascii")

    def sign_variant(self, folder: Path, repo: str, version: str, variant: str) -> bytes:
        """The signature file (``signature_path(variant)``) for the variant in ``folder``."""
        return sign_variant([self], folder, repo, version, variant)


def sign_variant(
    keys: Sequence[SigningKey], folder: Path, repo: str, version: str, variant: str
) -> bytes:
    """The signature file for the variant in ``folder``, signed by every one of ``keys`` (the
    first as ``key``/``signature``, the others as ``cosignatures``: a registry ``threshold``)."""
    signed = statement(repo, version, variant, (folder / "metadata.json").read_bytes())
    document = {"kernel-hub-signature": SIGNATURE_FORMAT, "signed": signed}
    document.update(signature_fields(keys, signed))
    return (json.dumps(document, indent=2) + "\n").encode("utf-8")


def signature_fields(keys: Sequence[SigningKey], signed: dict[str, str]) -> dict:
    """``key``, ``signature`` and (with several keys) ``cosignatures`` over ``signed``."""
    if not keys:
        raise KernelHubError("no signing key given")
    (key, signature), *others = [k.sign_statement(signed) for k in keys]
    fields: dict = {"key": key, "signature": signature}
    if others:
        fields["cosignatures"] = [{"key": k, "signature": s} for k, s in others]
    return fields


def signature_path(variant: str) -> str:
    """Where the signature of ``build/<variant>/`` lives in a repo (and in a cache snapshot)."""
    return f"{SIGNATURE_DIR}/{variant}.sig"


def statement(repo: str, version: str, variant: str, metadata: bytes) -> dict[str, str]:
    """What a signature vouches for: this metadata.json is ``repo``'s ``version``/``variant``."""
    digest = base64.b64encode(hashlib.sha256(metadata).digest()).decode("ascii")
    return {"repo": repo, "version": version, "variant": variant, "metadata": digest}


def _canonical(signed: dict[str, str]) -> bytes:
    return json.dumps(signed, sort_keys=True, separators=(",", ":")).encode("utf-8")


@dataclass(frozen=True)
class Signature:
    """A parsed ``metadata.json.sig``."""

    signed: dict[str, str]
    key: str
    signature: bytes
    cosignatures: tuple[tuple[str, bytes], ...] = ()

    @property
    def all(self) -> tuple[tuple[str, bytes], ...]:
        return ((self.key, self.signature), *self.cosignatures)


def read_signature(path: Path, text: str | None = None) -> Signature:
    """Parse a signature file; malformed input raises ``SourceError`` with line and field."""
    text, data = load_json(path, text, missing="the build is not signed (no signature file)")
    if not isinstance(data, dict) or data.get("kernel-hub-signature") != SIGNATURE_FORMAT:
        raise SourceError(
            path, 1, 'not a kernel-hub signature (expected "kernel-hub-signature": 1)'
        )

    def fail(field: str, message: str) -> SourceError:
        return SourceError(path, field_line(text, field), f"field {field!r}: {message}")

    unknown = sorted(set(data) - _FIELDS)
    if unknown:
        raise fail(unknown[0], f"unknown field; valid fields: {', '.join(sorted(_FIELDS))}")
    signed = data.get("signed")
    if not isinstance(signed, dict) or set(signed) != _SIGNED_FIELDS:
        raise fail("signed", f"expected a mapping with {', '.join(sorted(_SIGNED_FIELDS))}")
    if not all(isinstance(v, str) for v in signed.values()):
        raise fail("signed", "every value must be a string")
    key = data.get("key")
    if not isinstance(key, str) or not key:
        raise fail("key", f"expected the signing key's id, got {key!r}")
    signature = decode_signature(data.get("signature"))
    if signature is None:
        raise fail("signature", "expected the base64 of a 64-byte ed25519 signature")
    return Signature(dict(signed), key, signature, read_cosignatures(data, fail))


def decode_signature(raw: object) -> bytes | None:
    """The 64 bytes of a base64 ed25519 signature, or None."""
    try:
        signature = base64.b64decode(raw, validate=True) if isinstance(raw, str) else None
    except (binascii.Error, ValueError):
        return None
    return signature if signature is not None and len(signature) == 64 else None


def read_cosignatures(data: dict, fail) -> tuple[tuple[str, bytes], ...]:
    """``cosignatures: [{"key": ID, "signature": BASE64}, ...]`` (optional)."""
    raw = data.get("cosignatures", [])
    items = raw if isinstance(raw, list) else None
    parsed = []
    for item in items or ():
        signature = decode_signature(item.get("signature")) if isinstance(item, dict) else None
        if (
            signature is None
            or not isinstance(item.get("key"), str)
            or set(item)
            != {
                "key",
                "signature",
            }
        ):
            items = None
            break
        parsed.append((item["key"], signature))
    if items is None:
        raise fail("cosignatures", 'expected a list of {"key": ID, "signature": BASE64}')
    return tuple(parsed)


@dataclass(frozen=True)
class Verified:
    key: str
    """Id of the pinned key whose signature verified."""
    version: str
    """The version the publisher signed (the caller checks metadata.json says the same)."""


def verify_signature(
    signature_file: Path,
    metadata: bytes,
    *,
    repo: str,
    variant: str,
    keys: PublisherKeys,
    text: str | None = None,
) -> Verified:
    """Check the signature (``signature_file``, or its already-read ``text``) over these
    ``metadata`` bytes, before they are parsed and before anything of the variant is imported.

    The statement is rebuilt from the repo asked for, the variant and the bytes held; only the
    version is taken from the signature's claim, and the caller refuses a metadata.json that says
    another. Refused: no or malformed signature, a key the registry does not pin for the
    publisher, a key revoked anywhere in the registry, a signature that does not verify.
    Messages name the repo, version, variant and key.
    """
    what = f"{repo} build/{variant}"
    try:
        signature = read_signature(signature_file, text)
    except SourceError as exc:
        raise IntegrityError(f"{what}: {exc}") from None
    version = signature.signed["version"]
    expected = statement(repo, version, variant, metadata)
    claimed = ", ".join(
        f"{k} {signature.signed[k]!r}"
        for k in ("repo", "variant")
        if signature.signed.get(k) != expected[k]
    )
    detail = f"it was made for {claimed}" if claimed else "metadata.json is not what was signed"
    what = f"{repo} {version} build/{variant}"
    key = verify_statement(expected, signature.all, keys, what=what, detail=detail)
    return Verified(key, version)


def verify_statement(
    signed: dict[str, str],
    signatures: Sequence[tuple[str, bytes]],
    keys: PublisherKeys,
    *,
    what: str,
    detail: str = "it is not what was signed",
) -> str:
    """The first key of :func:`verify_signers`."""
    return verify_signers(signed, signatures, keys, what=what, detail=detail)[0]


def verify_signers(
    signed: dict[str, str],
    signatures: Sequence[tuple[str, bytes]],
    keys: PublisherKeys,
    *,
    what: str,
    detail: str = "it is not what was signed",
) -> tuple[str, ...]:
    """At least ``keys.threshold`` distinct keys, pinned for the publisher and not revoked, must
    have signed ``signed`` (signatures by other keys do not count); returns the ids of all such
    keys, or raises an ``IntegrityError`` starting with ``what``."""
    ed25519, _ = _crypto()
    from cryptography.exceptions import InvalidSignature

    revoked = {key_id(k) for k in keys.revoked}
    pinned = {key_id(k): k for k in keys.keys}
    where = keys.where()
    valid: list[str] = []
    problems: list[str] = []
    for key, signature in signatures:
        if key in revoked:
            problems.append(f"{what} is signed by key {key}, which {where} lists as revoked")
        elif key not in pinned:
            problems.append(
                f"{what} is signed by key {key}, which is not pinned for publisher "
                f"{keys.publisher!r} in {where} (pinned: {', '.join(sorted(pinned)) or 'none'})"
            )
        elif key not in valid:
            public = ed25519.Ed25519PublicKey.from_public_bytes(key_bytes(pinned[key]))
            try:
                public.verify(signature, _canonical(signed))
                valid.append(key)
            except InvalidSignature:
                problems.append(f"{what}: the signature by key {key} does not verify ({detail})")
    if len(valid) >= keys.threshold:
        return tuple(valid)
    if keys.threshold == 1:
        raise IntegrityError(problems[0])
    raise IntegrityError(
        f"{what} is signed by {len(valid)} of the {keys.threshold} pinned keys {where} requires "
        f"for publisher {keys.publisher!r}" + "".join(f"; {p}" for p in problems)
    )
