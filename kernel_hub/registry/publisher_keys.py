"""Publisher keys pinned in registry.yaml: the trust anchor for downloaded kernel builds.

    publishers:
      kernel-hub:                      # a hub organisation, or one repo as 'org/name'
        keys: [ed25519:BASE64...]      # builds signed by any of these are accepted (rotation)
        backup: [ed25519:BASE64...]    # offline keys: sign like 'keys', and only the registry
                                       # can revoke them (the signed index cannot)
        revoked: [ed25519:BASE64...]   # builds signed by these are refused, cached ones too
        index: true                    # require the publisher's signed, expiring index
        threshold: 2                   # builds and indexes need this many pinned keys' signatures

A key is written ``ed25519:`` + the base64 of its 32 raw bytes (what ``kernel-hub keygen``
prints). Only the text form is checked here; :mod:`kernel_hub.hub.signing` does the cryptography.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kernel_hub.errors import SourceError

from .yaml_source import FieldReader, line_of

KEY_PREFIX = "ed25519:"
KEY_BYTES = 32
_FIELDS = {"keys", "backup", "revoked", "index", "threshold"}


@dataclass(frozen=True)
class PublisherKeys:
    """The keys one publisher (an org, or one ``org/name`` repo) signs its builds with."""

    publisher: str
    keys: tuple[str, ...]
    """Every pinned key, ``backup`` ones included."""
    revoked: tuple[str, ...] = ()
    source: str = ""
    line: int | None = None
    index: bool = False
    """Loads must check the publisher's signed, expiring index (kernel_hub.hub.index)."""
    threshold: int = 1
    """How many distinct pinned keys must have signed a build or an index."""
    backup: tuple[str, ...] = ()
    """The offline backup keys among ``keys``: a signed index can revoke other keys, never these
    (kernel_hub.hub.index, key compromise recovery)."""
    index_keys: PublisherKeys | None = None
    """For a repo's keys (``keys_for``): its organisation's entry, whose keys alone sign the
    org's index; None when the registry has no entry for the organisation."""

    def where(self) -> str:
        return f"{self.source}:{self.line}" if self.line else self.source


def key_bytes(text: str) -> bytes:
    """The 32 raw bytes of a key written ``ed25519:BASE64``; ValueError saying why not."""
    if not isinstance(text, str) or not text.startswith(KEY_PREFIX):
        raise ValueError(f"expected '{KEY_PREFIX}' followed by base64, got {text!r}")
    try:
        raw = base64.b64decode(text[len(KEY_PREFIX) :].strip(), validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{text!r} is not valid base64 after '{KEY_PREFIX}'") from None
    if len(raw) != KEY_BYTES:
        raise ValueError(f"an ed25519 public key has {KEY_BYTES} bytes, {text!r} has {len(raw)}")
    return raw


def key_text(raw: bytes) -> str:
    return KEY_PREFIX + base64.b64encode(raw).decode("ascii")


def key_id(text_or_raw: str | bytes) -> str:
    """A short, stable name for a key in messages: ``ed25519:`` + 16 hex of its sha256."""
    raw = key_bytes(text_or_raw) if isinstance(text_or_raw, str) else text_or_raw
    return KEY_PREFIX + hashlib.sha256(raw).hexdigest()[:16]


def parse_publishers(path: Path, node: Any, line: int | None = None) -> dict[str, PublisherKeys]:
    """The ``publishers:`` section of a registry (``line``: where its key is, for a value such as
    ``null`` that carries no line of its own); errors name the file, line and field."""
    if not isinstance(node, dict):
        raise SourceError(
            path,
            line_of(node) or line,
            f"publishers: expected a mapping, got {type(node).__name__}",
        )
    publishers = {}
    for name, entry in node.items():
        line = node.lines.get(name) if hasattr(node, "lines") else None
        if not _publisher_name_ok(name):
            raise SourceError(
                path, line, f"publishers: {name!r} is not a hub organisation or 'org/name' repo"
            )
        fields = FieldReader(path, entry, f"publisher {name!r}", _FIELDS, line)
        keys = fields.get_str_list("keys")
        backup = fields.get_str_list("backup", ())
        revoked = fields.get_str_list("revoked", ())
        for field, values in (("keys", keys), ("backup", backup), ("revoked", revoked)):
            for value in values:
                try:
                    key_bytes(value)
                except ValueError as exc:
                    raise fields.error(field, str(exc)) from None
        both = sorted(set(keys) & set(backup))
        if both:
            raise fields.error("backup", f"key {key_id(both[0])} is in both 'keys' and 'backup'")
        pinned = (*keys, *backup)
        both = sorted(set(pinned) & set(revoked))
        if both:
            raise fields.error("revoked", f"key {key_id(both[0])} is both pinned and revoked")
        index = fields.get("index", bool, False)
        threshold = fields.get("threshold", int, 1)
        if not 1 <= threshold <= max(len(pinned), 1):
            raise fields.error("threshold", f"must be 1 to {len(pinned)} (the pinned keys)")
        publishers[name] = PublisherKeys(
            name, pinned, revoked, str(path), line, index, threshold, backup
        )
    return publishers


def _publisher_name_ok(name: str) -> bool:
    parts = name.split("/")
    return len(parts) <= 2 and all(part and part.strip() == part for part in parts)


def keys_for(publishers: Mapping[str, PublisherKeys], repo: str) -> PublisherKeys | None:
    """The keys pinned for ``repo``: its own entry, else its organisation's. A key revoked by
    any entry is revoked here too: revocation is about the key, so a repo-level entry can never
    hide its organisation's ``revoked:`` list. ``index_keys`` is the organisation's entry: a
    key pinned for one repo never signs the index every kernel of the org is checked against."""
    entry = publishers.get(repo) or publishers.get(repo.split("/", 1)[0])
    if entry is None:
        return None
    revoked = tuple(dict.fromkeys(k for p in publishers.values() for k in p.revoked))
    org = publishers.get(repo.split("/", 1)[0])
    index_keys = None if org is None else replace(org, revoked=revoked)
    return replace(
        entry,
        revoked=revoked,
        index=entry.index or (org is not None and org.index),
        index_keys=index_keys,
    )
