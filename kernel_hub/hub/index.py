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
* an index with a lower serial than the highest one a still-trusted key signed that this
  client accepted is refused (rollback), whatever the clock says;
* an expired index is refused, online and offline: the expiry is how long a frozen hub can
  replay the last index it got (publishers refresh it with ``kernel-hub index refresh``); the
  clock is never taken to be earlier than the last time this client accepted an index.

Key compromise (``kernel-hub index revoke``): an index may carry ``"revoked": [KEY, ...]``. A
client that verifies it (signed by pinned keys other than the ones it revokes) refuses those keys
from then on, for every index and build of the publisher, cached or not, and never forgets them;
a key under ``backup:`` in the registry can only be revoked by the registry, so a thief holding
one ordinary key cannot lock the publisher's backup key out. Serials signed by a revoked key stop
counting, so an index the thief signed with a huge serial does not block the backup's.

Online the index is fetched on every resolve; what the client accepted (the last index, the
highest serial each key signed, the revocations learned, the time) is one file per publisher and
hub cache in this user's state folder (``settings.state_dir``), replaced atomically under a lock.
It is kept outside the hub cache because a cache may be shared: a neighbour who can write it could
delete the record, and with it a revocation learned only from an index or the serial that stops a
rollback. Offline the recorded index is verified again and honoured until it expires.
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
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from packaging.version import InvalidVersion, Version

from kernel_hub.errors import HubError, IntegrityError, SourceError
from kernel_hub.registry.publisher_keys import PublisherKeys, key_bytes, key_id
from kernel_hub.user_cache import others_can_write

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
    verify_signers,
)
from .transfer import MAX_METADATA_BYTES, MAX_SIGNATURE_BYTES, fetch_bytes

INDEX_FORMAT = 1
INDEX_NAME = "kernel-hub-index"
INDEX_FILE = "index.json"
SIGNATURE_FILE = "index.sig"
DEFAULT_EXPIRY_DAYS = 7
RECORD_FOLDER = "index"
CACHED_FILE = "index.signed.json"
"""What this client accepted (:class:`Seen`): the index, its signature and the high-water marks in
one file, so that one write replaces them all. Earlier versions kept it in the hub cache
(:func:`cached_index_dir`), where it is read while this user has no record of its own."""
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
    revoked: tuple[str, ...] = ()
    """Keys (``ed25519:BASE64``) this index revokes."""
    signers: tuple[str, ...] = ()
    """Ids of the pinned, unrevoked keys whose signatures verified."""

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
    publisher: str,
    serial: int,
    expires: dt.datetime,
    kernels: Mapping[str, Mapping[str, str]],
    revoked: Sequence[str] = (),
) -> bytes:
    document = {
        "kernel-hub-index": INDEX_FORMAT,
        "publisher": publisher,
        "serial": serial,
        "expires": _iso(expires),
        "kernels": {r: dict(sorted(v.items())) for r, v in sorted(kernels.items())},
    }
    if revoked:
        document["revoked"] = sorted(set(revoked))
    return (json.dumps(document, indent=2) + "\n").encode("utf-8")


def verify_index(data: bytes, signature: bytes, publisher: str, keys: PublisherKeys) -> Index:
    """Check the signature over ``data`` (by keys pinned for the publisher, not revoked), then
    parse it; expiry is the caller's (:func:`check_fresh`). An index that revokes a ``backup``
    key, or the keys it is signed by, is refused."""
    what = f"{publisher}'s index"
    path = Path(INDEX_FILE)
    _, doc = load_json(Path(SIGNATURE_FILE), decode(Path(SIGNATURE_FILE), signature))

    def fail(field: str, message: str) -> IntegrityError:
        return IntegrityError(f"{what}: {SIGNATURE_FILE} field {field!r}: {message}")

    sig = decode_signature(doc.get("signature")) if isinstance(doc, dict) else None
    if sig is None or not isinstance(doc.get("key"), str):
        raise IntegrityError(f"{what}: {SIGNATURE_FILE} is not a kernel-hub index signature")
    signatures = ((doc["key"], sig), *read_cosignatures(doc, fail))
    signers = verify_signers(_statement(publisher, data), signatures, keys, what=what)
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
        revoked = node.get("revoked", [])
        if not isinstance(revoked, list):
            raise ValueError("'revoked' is not a list")
        revoked = tuple(dict.fromkeys(revoked))
        for key in revoked:
            key_bytes(key)
    except (KeyError, TypeError, ValueError, AttributeError, InvalidVersion) as exc:
        raise SourceError(path, 1, f"{what} is malformed ({exc})") from None
    backup = sorted(set(revoked) & set(keys.backup))
    if backup:
        raise IntegrityError(
            f"{what} revokes backup key {key_id(backup[0])}: only the registry can revoke a key "
            f"it lists under 'backup:' ({keys.where()})"
        )
    gone = {key_id(k) for k in revoked}
    left = tuple(k for k in signers if k not in gone)
    if len(left) < keys.threshold:
        raise IntegrityError(
            f"{what} revokes the key it is signed by ({', '.join(sorted(gone & set(signers)))}); "
            "a revocation must be signed by other pinned keys (the backup key)"
        )
    return Index(publisher, serial, expires, kernels, data, signature, revoked, left)


def check_fresh(index: Index, what: str, seen: dt.datetime | None = None) -> Index:
    """Refuse an expired index; the clock is taken to be no earlier than ``seen`` (the last time
    this client accepted an index), so setting it back does not revive an old index."""
    clock = now()
    moment = clock if seen is None else max(clock, seen)
    if index.expires <= moment:
        behind = (
            f" (this machine's clock says {_iso(clock)}, but it accepted an index at "
            f"{_iso(moment)}: the clock was set back)"
            if moment > clock
            else ""
        )
        raise IntegrityError(
            f"{what}: {index.describe()} has expired{behind}: a hub that stopped receiving "
            "updates could be hiding newer versions. The publisher refreshes it with 'kernel-hub "
            "index refresh'; offline, nothing of this publisher loads until a fresh index was "
            "fetched online"
        )
    return index


def cached_index_dir(publisher: str) -> Path:
    return settings.cache_dir() / f"{REPO_TYPE}s--{index_repo(publisher).replace('/', '--')}"


@dataclass(frozen=True)
class Seen:
    """What this client accepted of a publisher's index: one file of its state folder."""

    data: bytes
    signature: bytes
    """The last index accepted and its signature (what offline loads are checked against)."""
    serials: Mapping[str, int] | None
    """Key id -> the highest serial it signed that this client accepted (None: a cache written
    before these were kept; derived from the cached index)."""
    revoked: tuple[str, ...]
    """Keys the publisher's indexes revoked: never forgotten."""
    seen: dt.datetime | None
    """The latest clock reading at which an index was accepted."""


def seen_record_path(publisher: str) -> Path:
    """This user's record of ``publisher``'s index for the current hub cache: one folder per cache
    (named by a hash of its path), so another cache starts afresh, as it did when the record lived
    in the cache."""
    cache_key = hashlib.sha256(os.fsencode(os.path.abspath(settings.cache_dir()))).hexdigest()
    return settings.state_dir() / RECORD_FOLDER / cache_key[:32] / f"{publisher}.{CACHED_FILE}"


def _record_folders(folder: Path, *, create: bool) -> Path:
    """``folder`` and the state folders above it (created private, 0700, when missing and
    ``create``), each one only this user can write; else a ``HubError``: a record someone else
    could delete would let a revoked key be trusted again."""
    root = settings.state_dir()
    for current in (root, root / RECORD_FOLDER, folder):
        if create:
            try:
                current.mkdir(mode=0o700, parents=current == root, exist_ok=True)
            except OSError as exc:
                raise HubError(
                    f"kernel-hub's state folder {current} cannot be made: {exc.strerror or exc}; "
                    f"point {settings.ENV_STATE_DIR} at a directory only you can write"
                ) from None
        elif not current.is_dir():
            break
        problem = others_can_write(current)
        if problem:
            raise HubError(
                f"refusing kernel-hub's state folder {current}: {problem}. It keeps the "
                f"revocations and index serials this client learned; point "
                f"{settings.ENV_STATE_DIR} at a directory only you can write"
            )
    return folder


def _read_capped(path: Path) -> bytes | None:
    """The bytes of the record at ``path`` (None when there is none); a link is refused."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except (FileNotFoundError, NotADirectoryError):  # an unusable cache is named where it is used
        return None
    except OSError as exc:  # ELOOP: a planted symlink
        raise HubError(f"refusing the cached index {path}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "rb") as f:
        return f.read(_MAX_CACHED_BYTES + 1)


def _read_seen(publisher: str) -> Seen | None:
    """This user's record (:func:`_write_seen`), else the one an earlier version kept in the hub
    cache; unverified; None when there is none or it does not read as one (it only holds copies
    and marks: losing this user's own costs a fetch and the rollback marks)."""
    path = seen_record_path(publisher)
    _record_folders(path.parent, create=False)
    raw = _read_capped(path)
    if raw is None:
        raw = _read_capped(cached_index_dir(publisher) / CACHED_FILE)
    return None if raw is None else _parse_seen(raw)


def _parse_seen(raw: bytes) -> Seen | None:
    try:
        document = json.loads(raw)
        serials = document.get("serials")
        if serials is not None and not all(
            isinstance(k, str) and type(v) is int for k, v in serials.items()
        ):
            raise ValueError("bad serials")
        revoked = tuple(document.get("revoked", ()))
        for key in revoked:
            key_bytes(key)
        seen = document.get("seen")
        seen = None if seen is None else dt.datetime.fromisoformat(seen)
        if seen is not None and seen.tzinfo is None:
            raise ValueError("a time without a zone")
        return Seen(
            base64.b64decode(document["index"], validate=True),
            base64.b64decode(document["signature"], validate=True),
            serials,
            revoked,
            seen,
        )
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def _write_seen(publisher: str, seen: Seen) -> None:
    """The record as one file, replaced atomically: a reader sees one serial's pair and marks."""
    path = seen_record_path(publisher)
    folder = _record_folders(path.parent, create=True)
    document = {
        "index": base64.b64encode(seen.data).decode("ascii"),
        "signature": base64.b64encode(seen.signature).decode("ascii"),
        "serials": dict(seen.serials or {}),
        "revoked": list(seen.revoked),
        "seen": None if seen.seen is None else seen.seen.isoformat(),
    }
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(document, f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _with_revoked(keys: PublisherKeys, revoked: Sequence[str]) -> PublisherKeys:
    extra = tuple(k for k in revoked if k not in keys.revoked)
    if not extra:
        return keys
    source = f"{keys.where()} or the publisher's signed index"
    return replace(keys, revoked=(*keys.revoked, *extra), source=source, line=None)


def with_learned_revocations(keys: PublisherKeys) -> PublisherKeys:
    """``keys`` plus every key the publisher's signed index revoked, as this client learned it:
    builds signed by them are refused too, cached or not."""
    org = keys.publisher.split("/", 1)[0]
    if not _ORG.match(org):
        return keys
    seen = _read_seen(org)
    return keys if seen is None else _with_revoked(keys, seen.revoked)


@contextlib.contextmanager
def _cache_lock(publisher: str, what: str) -> Iterator[None]:
    """Held while the cached index is compared with a fetched one and replaced."""
    org = publisher.split("/", 1)[0]
    with cache.lock_file(
        settings.cache_dir() / cache.SHARED_LOCKS / "kernel-hub" / f"index-{org}.lock",
        timeout=network.remaining(what),
        expired=lambda detail: network.deadline_error(f"{what}: {detail}"),
        waiting_for=f"another update of {org}'s cached index",
    ):
        yield


def _fetch_signed(publisher: str, what: str) -> tuple[bytes, bytes] | None:
    """``index.json`` and ``index.sig`` at the head of the hub's index repo, unverified (None:
    the hub has none)."""
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
    return data, signature


def current_index(publisher: str, keys: PublisherKeys, *, online: bool, what: str) -> Index:
    """The index to check loads against: fetched (online) or cached (offline), verified against
    ``keys`` and the revocations this client learned, no older than any a still-trusted key
    signed that this client accepted, not expired."""
    if not online:
        seen = _read_seen(publisher)
        if seen is None:
            raise HubError(
                f"{what}: the registry requires {publisher}'s signed index and none is cached; "
                "fetch once online"
            )
        cached = verify_index(
            seen.data, seen.signature, publisher, _with_revoked(keys, seen.revoked)
        )
        return check_fresh(cached, what, seen.seen)
    signed = _fetch_signed(publisher, what)
    if signed is None:
        raise IntegrityError(
            f"{what}: the registry requires {publisher}'s signed index, but the hub at "
            f"{settings.endpoint()} serves none ({index_repo(publisher)})"
        )
    with _cache_lock(publisher, what):
        seen = _read_seen(publisher)
        learned = seen.revoked if seen is not None else ()
        fetched = verify_index(*signed, publisher, _with_revoked(keys, learned))
        revoked = tuple(dict.fromkeys((*learned, *fetched.revoked)))
        gone = {key_id(k) for k in (*keys.revoked, *revoked)}
        serials = {
            k: v for k, v in (_serials(seen, publisher, keys) or {}).items() if k not in gone
        }
        floor = max(serials.values(), default=None)
        if floor is not None and (
            fetched.serial < floor or (fetched.serial == floor and fetched.data != seen.data)
        ):
            raise IntegrityError(
                f"{what}: the hub serves {fetched.describe()}, but this client already verified "
                f"serial {floor}: the index was rolled back"
            )
        check_fresh(fetched, what, seen.seen if seen is not None else None)
        for key in fetched.signers:
            serials[key] = max(serials.get(key, fetched.serial), fetched.serial)
        clock = now() if seen is None or seen.seen is None else max(now(), seen.seen)
        _write_seen(publisher, Seen(fetched.data, fetched.signature, serials, revoked, clock))
    return fetched


def _serials(seen: Seen | None, publisher: str, keys: PublisherKeys) -> Mapping[str, int] | None:
    """The high-water marks; for a cache written before they were kept, the cached index's
    serial for the keys that signed it (none if it no longer verifies)."""
    if seen is None or seen.serials is not None:
        return None if seen is None else seen.serials
    try:
        cached = verify_index(seen.data, seen.signature, publisher, keys)
    except (IntegrityError, SourceError):
        return None
    return dict.fromkeys(cached.signers, cached.serial)


Vet = Callable[[Mapping[str, Mapping[str, str]], Sequence[str]], dict[str, dict[str, str]]]
"""(repo -> version -> commit, revoked keys) -> the entries whose builds are still signed by
trusted keys (:func:`kernel_hub.hub.recovery.vet_listed`)."""


def publish_index(
    publisher: str,
    key: SigningKey | Sequence[SigningKey],
    keys: PublisherKeys,
    *,
    add: Mapping[str, tuple[Version, str]] | None = None,
    revoke: Sequence[str] = (),
    vet: Vet | None = None,
    expires_days: float = DEFAULT_EXPIRY_DAYS,
    token: str | bool | None = None,
) -> Index:
    """Sign and upload the next index: the hub's current one plus ``add`` (repo -> (version,
    commit)), with a new serial and expiry, carrying its revocations forward and adding
    ``revoke`` (public keys).

    The current index must verify against ``keys`` (the keys and threshold the publisher's
    clients pin) less ``revoke``. One signed by a revoked key (the thief's, or the last one
    before the compromise) still sets the serial, but its revocations are dropped and of its
    entries only those ``vet`` finds signed by trusted keys are kept; ``vet`` also runs whenever
    ``revoke`` is given, and is required then. An index clients would refuse (signed by a key
    it revokes, revoking a backup key, below the threshold) is not uploaded."""
    from huggingface_hub import CommitOperationAdd

    if expires_days <= 0:
        raise HubError(f"expires_days must be positive, got {expires_days}")
    what = f"publishing {publisher}'s index"
    signers = [key] if isinstance(key, SigningKey) else list(key)
    raw = _fetch_signed(publisher, what)
    current, trusted = (None, True) if raw is None else _current(raw, publisher, keys, revoke)
    carried = current.revoked if current is not None and trusted else ()
    revoked = tuple(dict.fromkeys((*carried, *revoke)))
    kernels = {
        repo: {str(v): c for v, c in versions.items()}
        for repo, versions in (current.kernels.items() if current else ())
    }
    if revoke or not trusted:
        if vet is None:
            raise HubError(
                f"{what}: the listed builds must be checked for signatures by revoked keys "
                "(use 'kernel-hub index revoke' or 'kernel-hub index refresh')"
            )
        kernels = vet(kernels, (*keys.revoked, *revoked))
    for repo, (version, commit) in (add or {}).items():
        kernels.setdefault(repo, {})[str(version)] = commit
    serial = (current.serial if current else 0) + 1
    expires = now() + dt.timedelta(days=expires_days)
    data = make_index(publisher, serial, expires, kernels, revoked)
    signature = sign_index(signers, publisher, data)
    signed = verify_index(data, signature, publisher, _with_revoked(keys, revoked))  # as clients
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


def _current(
    raw: tuple[bytes, bytes], publisher: str, keys: PublisherKeys, revoke: Sequence[str]
) -> tuple[Index, bool]:
    """The hub's current index and whether its content can be trusted: verified against
    ``keys`` less ``revoke``, else against every key pinned or revoked (signed before or by the
    thief: untrusted); anything else is refused."""
    try:
        return verify_index(*raw, publisher, _with_revoked(keys, revoke)), True
    except IntegrityError as refused:
        every = tuple(dict.fromkeys((*keys.keys, *keys.revoked, *revoke)))
        lenient = replace(keys, keys=every, revoked=(), backup=())
        try:
            return verify_index(*raw, publisher, lenient), False
        except IntegrityError:
            raise refused from None
