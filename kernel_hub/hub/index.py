"""A publisher's signed, expiring index: which versions of its kernels exist, at which commits.

TUF's snapshot and timestamp roles folded into one document, signed by a key the registry pins
for the publisher. It lives in the hub repo ``<org>/kernel-hub-index`` (files ``index.json`` and
``index.sig``)::

    {"kernel-hub-index": 1, "publisher": "kernel-hub", "serial": 7,
     "expires": "2026-12-08T00:00:00Z",
     "kernels": {"kernel-hub/rmsnorm": {"1.0.0": "<40 hex>", "1.1.0": "<40 hex>"}}}

signed as ``{"publisher": ORG, "index": base64 sha256(index.json)}``. When the registry says
``index: true`` for a publisher, every load of its kernels checks it (:func:`check_resolved`):

* the commit a request resolved to must be listed, and the build there is bound to the listed
  version (a relabelled commit or tag is refused);
* a version range or a ``vN`` branch must have resolved to the newest listed version that fits
  (a hub that hides a newer version or moves a branch back is caught);
* an index with a lower serial than one this client already verified is refused (rollback);
* an expired index is refused, online and offline: the expiry is how long a frozen hub can
  replay the last index it got (publishers refresh it with ``kernel-hub index refresh``).

Online the index is fetched on every resolve and kept in the cache once verified; offline the
cached copy is verified again and honoured until it expires.
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import hashlib
import json
import os
import re
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from packaging.version import InvalidVersion, Version

from kernel_hub.errors import HubError, IntegrityError, SourceError
from kernel_hub.registry.publisher_keys import PublisherKeys

from . import cache, network, settings
from .client import REPO_TYPE, hub_api, hub_errors, list_refs
from .json_source import decode, load_json
from .lockfile import COMMIT
from .network import MissingOnHub
from .signing import (
    SigningKey,
    decode_signature,
    read_cosignatures,
    signature_fields,
    verify_statement,
)
from .transfer import MAX_METADATA_BYTES, MAX_SIGNATURE_BYTES, fetch_bytes

INDEX_FORMAT = 1
INDEX_NAME = "kernel-hub-index"
INDEX_FILE = "index.json"
SIGNATURE_FILE = "index.sig"
DEFAULT_EXPIRY_DAYS = 7
CACHED_FILE = "index.signed.json"
"""The cache's copy: index.json and index.sig in one file, so that one write replaces both."""
_MAX_CACHED_BYTES = 2 * (MAX_METADATA_BYTES + MAX_SIGNATURE_BYTES)
_ORG = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


@dataclass(frozen=True)
class Index:
    publisher: str
    serial: int
    expires: dt.datetime
    kernels: Mapping[str, Mapping[Version, str]]
    """repo -> version -> commit."""
    data: bytes
    signature: bytes

    def describe(self) -> str:
        return (
            f"{self.publisher}'s signed index (serial {self.serial}, expires {_iso(self.expires)})"
        )


def index_repo(publisher: str) -> str:
    org = publisher.split("/", 1)[0]
    if not _ORG.match(org):
        raise HubError(f"{org!r} is not a hub organisation name")
    return f"{org}/{INDEX_NAME}"


def _iso(moment: dt.datetime) -> str:
    return moment.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _statement(publisher: str, data: bytes) -> dict[str, str]:
    digest = base64.b64encode(hashlib.sha256(data).digest()).decode("ascii")
    return {"publisher": publisher, "index": digest}


def sign_index(keys: Sequence[SigningKey], publisher: str, data: bytes) -> bytes:
    document = {"kernel-hub-index-signature": 1}
    document.update(signature_fields(keys, _statement(publisher, data)))
    return (json.dumps(document, indent=2) + "\n").encode("utf-8")


def make_index(
    publisher: str, serial: int, expires: dt.datetime, kernels: Mapping[str, Mapping[str, str]]
) -> bytes:
    document = {
        "kernel-hub-index": INDEX_FORMAT,
        "publisher": publisher,
        "serial": serial,
        "expires": _iso(expires),
        "kernels": {r: dict(sorted(v.items())) for r, v in sorted(kernels.items())},
    }
    return (json.dumps(document, indent=2) + "\n").encode("utf-8")


def verify_index(data: bytes, signature: bytes, publisher: str, keys: PublisherKeys) -> Index:
    """Check the signature over ``data`` (by a key pinned for the publisher, not revoked), then
    parse it; expiry is the caller's (:func:`check_fresh`)."""
    what = f"{publisher}'s index"
    path = Path(INDEX_FILE)
    _, doc = load_json(Path(SIGNATURE_FILE), decode(Path(SIGNATURE_FILE), signature))

    def fail(field: str, message: str) -> IntegrityError:
        return IntegrityError(f"{what}: {SIGNATURE_FILE} field {field!r}: {message}")

    sig = decode_signature(doc.get("signature")) if isinstance(doc, dict) else None
    if sig is None or not isinstance(doc.get("key"), str):
        raise IntegrityError(f"{what}: {SIGNATURE_FILE} is not a kernel-hub index signature")
    signatures = ((doc["key"], sig), *read_cosignatures(doc, fail))
    verify_statement(_statement(publisher, data), signatures, keys, what=what)
    _, node = load_json(path, decode(path, data))
    try:
        if node["kernel-hub-index"] != INDEX_FORMAT or node["publisher"] != publisher:
            raise ValueError("not this publisher's index")
        serial = node["serial"]
        expires = dt.datetime.strptime(node["expires"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.UTC)
        kernels = {
            repo: {Version(v): c for v, c in versions.items()}
            for repo, versions in node["kernels"].items()
        }
        if type(serial) is not int or not all(
            COMMIT.match(c) for versions in kernels.values() for c in versions.values()
        ):
            raise ValueError("bad serial or commit id")
    except (KeyError, TypeError, ValueError, AttributeError, InvalidVersion) as exc:
        raise SourceError(path, 1, f"{what} is malformed ({exc})") from None
    return Index(publisher, serial, expires, kernels, data, signature)


def check_fresh(index: Index, what: str) -> Index:
    if index.expires <= now():
        raise IntegrityError(
            f"{what}: {index.describe()} has expired: a hub that stopped receiving updates could "
            "be hiding newer versions. The publisher refreshes it with 'kernel-hub index refresh'"
            "; offline, nothing of this publisher loads until a fresh index was fetched online"
        )
    return index


def cached_index_dir(publisher: str) -> Path:
    return settings.cache_dir() / f"{REPO_TYPE}s--{index_repo(publisher).replace('/', '--')}"


def _read_cached(publisher: str, keys: PublisherKeys) -> Index | None:
    """The cached index (both files in one, :func:`_write_cached`), verified; None when absent
    or unreadable as one (it is only a copy of what the hub serves)."""
    path = cached_index_dir(publisher) / CACHED_FILE
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        return None
    except OSError as exc:  # ELOOP: a planted symlink
        raise HubError(f"refusing the cached index {path}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "rb") as f:
        raw = f.read(_MAX_CACHED_BYTES + 1)
    try:
        document = json.loads(raw)
        data = base64.b64decode(document["index"], validate=True)
        signature = base64.b64decode(document["signature"], validate=True)
    except (ValueError, KeyError, TypeError):
        return None
    return verify_index(data, signature, publisher, keys)


def _write_cached(index: Index) -> None:
    """Index and signature as one file, replaced atomically: a reader sees one serial's pair."""
    folder = cache.checked_dir(cached_index_dir(index.publisher))
    document = {
        "index": base64.b64encode(index.data).decode("ascii"),
        "signature": base64.b64encode(index.signature).decode("ascii"),
    }
    fd, tmp = tempfile.mkstemp(prefix=f".{CACHED_FILE}-", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(document, f)
        os.replace(tmp, folder / CACHED_FILE)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def _cache_lock(publisher: str, what: str) -> Iterator[None]:
    """Held while the cached index is compared with a fetched one and replaced."""
    org = publisher.split("/", 1)[0]
    with cache.lock_file(
        settings.cache_dir() / ".locks" / "kernel-hub" / f"index-{org}.lock",
        timeout=network.remaining(what),
        expired=lambda detail: network.deadline_error(f"{what}: {detail}"),
        waiting_for=f"another update of {org}'s cached index",
    ):
        yield


def fetch_index(publisher: str, keys: PublisherKeys, what: str) -> Index | None:
    """The newest index on the hub (verified; None when the hub has none), without the
    freshness and rollback checks."""
    repo = index_repo(publisher)
    try:
        _, branches, _ = list_refs(repo)
    except network.Unreachable:
        raise
    except HubError:  # no index repo
        return None
    commit = branches.get("main")
    if commit is None:
        return None
    where = f"{what}: downloading {repo}"
    try:
        data = fetch_bytes(repo, commit, INDEX_FILE, limit=MAX_METADATA_BYTES, where=where)
        signature = fetch_bytes(
            repo, commit, SIGNATURE_FILE, limit=MAX_SIGNATURE_BYTES, where=where
        )
    except MissingOnHub:
        return None
    return verify_index(data, signature, publisher, keys)


def current_index(publisher: str, keys: PublisherKeys, *, online: bool, what: str) -> Index:
    """The index to check loads against: fetched (online) or cached (offline), verified, no
    older than any this client saw, not expired."""
    if not online:
        cached = _read_cached(publisher, keys)
        if cached is None:
            raise HubError(
                f"{what}: the registry requires {publisher}'s signed index and none is cached; "
                "fetch once online"
            )
        return check_fresh(cached, what)
    fetched = fetch_index(publisher, keys, what)
    if fetched is None:
        raise IntegrityError(
            f"{what}: the registry requires {publisher}'s signed index, but the hub at "
            f"{settings.endpoint()} serves none ({index_repo(publisher)})"
        )
    with _cache_lock(publisher, what):
        cached = _read_cached(publisher, keys)
        if cached is not None and (
            fetched.serial < cached.serial
            or (fetched.serial == cached.serial and fetched.data != cached.data)
        ):
            raise IntegrityError(
                f"{what}: the hub serves {fetched.describe()}, but this client already verified "
                f"serial {cached.serial}: the index was rolled back"
            )
        check_fresh(fetched, what)
        _write_cached(fetched)
    return fetched


def publish_index(
    publisher: str,
    key: SigningKey | Sequence[SigningKey],
    keys: PublisherKeys,
    *,
    add: Mapping[str, tuple[Version, str]] | None = None,
    expires_days: float = DEFAULT_EXPIRY_DAYS,
    token: str | bool | None = None,
) -> Index:
    """Sign and upload the next index: the current one (verified against ``keys``, the keys and
    threshold the publisher's clients pin), plus ``add`` (repo -> (version, commit)), a new
    serial and expiry. An index those keys would refuse is not uploaded."""
    from huggingface_hub import CommitOperationAdd

    if expires_days <= 0:
        raise HubError(f"expires_days must be positive, got {expires_days}")
    what = f"publishing {publisher}'s index"
    current = fetch_index(publisher, keys, what)
    kernels = {
        repo: {str(v): c for v, c in versions.items()}
        for repo, versions in (current.kernels.items() if current else ())
    }
    for repo, (version, commit) in (add or {}).items():
        kernels.setdefault(repo, {})[str(version)] = commit
    serial = (current.serial if current else 0) + 1
    data = make_index(publisher, serial, now() + dt.timedelta(days=expires_days), kernels)
    signers = [key] if isinstance(key, SigningKey) else list(key)
    signature = sign_index(signers, publisher, data)
    signed = verify_index(data, signature, publisher, keys)  # what clients will check
    repo = index_repo(publisher)
    api = hub_api(token)
    with hub_errors(what):
        api.create_repo(repo, repo_type=REPO_TYPE, exist_ok=True)
        api.create_commit(
            repo,
            [
                CommitOperationAdd(path_in_repo=INDEX_FILE, path_or_fileobj=data),
                CommitOperationAdd(path_in_repo=SIGNATURE_FILE, path_or_fileobj=signature),
            ],
            commit_message=f"index serial {serial}",
            repo_type=REPO_TYPE,
        )
    return signed
