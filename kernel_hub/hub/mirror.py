"""``kernel-hub mirror``: copy the builds a registry (or a lock) needs into a store directory.

The mirror verifies before it copies: every variant is downloaded from ``HF_ENDPOINT`` and
checked exactly as ``get_kernel`` checks it (pinned publisher key, signed digests, the lock's
digests when mirroring a lock), so a mirror never holds a build its clients would refuse. It
keeps the upstream commit ids, tags and ``vX`` branches, so lock files and version ranges resolve
against the mirror as against the hub, and clients still verify every build themselves: the
mirror is no trust anchor, only a copy. A publisher whose registry entry requires its signed
index (``index: true``) has that index verified and copied too, so clients behind the mirror
check freshness as against the hub (until the copied index expires: re-run the mirror).
Serve the directory with ``kernel-hub serve``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from packaging.version import Version

from kernel_hub.errors import HubError
from kernel_hub.registry.publisher_keys import PublisherKeys
from kernel_hub.registry.registry import OpEntry, Registry

from .client import REPO_TYPE, list_refs
from .fetch import (
    HubRequest,
    Resolved,
    VerifiedBuild,
    fetch_all_variants,
    index_keys,
    require_keys,
    resolve_online,
)
from .index import INDEX_FILE, SIGNATURE_FILE, current_index, index_repo
from .lockfile import LockFile
from .signing import signature_path
from .store import Commit, RepoStore
from .trust import TrustRemoteCode, check_trusted
from .versions import tag_name


@dataclass(frozen=True)
class Mirrored:
    op: str
    repo: str
    version: Version
    commit: str
    variants: tuple[str, ...]
    refs: tuple[str, ...]
    copied: bool
    """False when the store already held this commit."""


def mirror_registry(
    registry: Registry,
    to: str | Path,
    ops: Iterable[str] | None = None,
    *,
    lock: LockFile | None = None,
    trust_remote_code: TrustRemoteCode = False,
) -> tuple[list[Mirrored], dict[str, str]]:
    """Mirror ``ops`` (default: every op with a hub repo); returns (copied builds, skipped ops
    with the reason)."""
    store = RepoStore(to)
    entries = [registry.get(op) for op in ops] if ops is not None else list(registry)
    done: list[Mirrored] = []
    skipped: dict[str, str] = {}
    indexed: dict[str, PublisherKeys] = {}
    for entry in entries:
        if entry.repo is None:
            skipped[entry.name] = "no 'repo' in the registry: in-tree only"
            continue
        what = f"mirroring op {entry.name}"
        check_trusted(entry.repo, trust_remote_code)
        keys = require_keys(entry.repo, registry.keys_for(entry.repo), what)
        if keys.index:
            indexed[entry.repo.split("/", 1)[0]] = index_keys(entry.repo, keys, what)
        locked = lock.ops.get(entry.name) if lock is not None else None
        versions, branches, tags = list_refs(entry.repo)
        for resolved in _wanted(entry, versions, lock, what):
            pin = locked if locked is not None and locked.commit == resolved.commit else None
            # verified every time (from the local cache when already downloaded)
            builds = fetch_all_variants(entry.repo, resolved, keys, what, pin, copy=True)
            copied = not (
                store.has_repo(REPO_TYPE, entry.repo)
                and store.commit(REPO_TYPE, entry.repo, resolved.commit) is not None
            )
            if copied:
                try:
                    _copy(store, entry.repo, resolved.commit, builds, what)
                except OSError as exc:
                    raise HubError(
                        f"{what}: writing {store.root} failed ({exc.strerror or exc}); the store "
                        f"holds no part of {entry.repo} {resolved.commit[:12]} (a commit is "
                        "recorded only after all its files are written)"
                    ) from exc
            refs = _copy_refs(store, entry.repo, resolved.commit, branches, tags)
            version = next(iter(builds.values())).metadata.version
            done.append(
                Mirrored(
                    entry.name,
                    entry.repo,
                    version,
                    resolved.commit,
                    tuple(sorted(builds)),
                    refs,
                    copied,
                )
            )
    for org, keys in sorted(indexed.items()):
        _copy_index(store, org, keys)
    return done, skipped


def _copy_index(store: RepoStore, org: str, keys: PublisherKeys) -> None:
    """The publisher's current index, verified, as the head of the mirror's index repo."""
    signed = current_index(org, keys, online=True, what=f"mirroring {org}'s index")
    repo = index_repo(org)
    store.ensure_repo(REPO_TYPE, repo)
    head = store.resolve(REPO_TYPE, repo, "main")
    files = {INDEX_FILE: signed.data, SIGNATURE_FILE: signed.signature}
    if {p: store.read_blob(f) for p, f in head.files.items()} != files:
        store.commit_files(
            REPO_TYPE,
            repo,
            "main",
            added=files,
            deleted=[],
            deleted_folders=[],
            message=f"mirror of {repo}, serial {signed.serial}",
            parent=None,
        )


def _wanted(entry: OpEntry, versions, lock: LockFile | None, what: str) -> list[Resolved]:
    """The commits to mirror: the lock's pin, else the registry's revision/commit, else every
    version tag in the registry's range."""
    locked = lock.ops.get(entry.name) if lock is not None else None
    if locked is not None:
        return [Resolved(locked.commit, locked.commit, locked.version)]
    if entry.commit is not None or entry.revision is not None:
        return [resolve_online(HubRequest.for_op(entry), what)]
    wanted = sorted(v for v in versions if entry.version.contains(v, prereleases=True))
    if not wanted:
        listing = ", ".join(map(str, sorted(versions))) or "(none)"
        raise HubError(
            f"{what}: {entry.repo} has no version in {entry.version}; versions: {listing}"
        )
    return [Resolved(versions[v], tag_name(v), v) for v in wanted]


def _copy(
    store: RepoStore, repo: str, commit: str, builds: Mapping[str, VerifiedBuild], what: str
) -> None:
    """The verified variants into the store, as ``commit``: the signature bytes that verified and
    the files from this process's private copy of the bytes hashed, never read again from the
    shared cache (a file swapped there after the check would reach every client of the mirror)."""
    files = {}
    for variant, build in sorted(builds.items()):
        files[signature_path(variant)] = store.put_blob(build.signature)
        for name in sorted(build.digests):
            files[f"build/{variant}/{name}"] = store.put_blob((build.copy / name).read_bytes())
    if not files:
        raise HubError(f"{what}: {repo} at {commit[:12]} has no build files")
    store.ensure_repo(REPO_TYPE, repo)
    store.write_commit(REPO_TYPE, repo, Commit(commit, None, f"mirror of {repo}", files))


def _copy_refs(
    store: RepoStore, repo: str, commit: str, branches: dict[str, str], tags: dict[str, str]
) -> tuple[str, ...]:
    """Upstream tags and branches that point at ``commit``, pointed at it in the store too."""
    names = []
    for kind, refs in (("tag", tags), ("branch", branches)):
        for name, target in sorted(refs.items()):
            if target == commit:
                store.set_ref(REPO_TYPE, repo, kind, name, commit, create=False)
                names.append(name)
    return tuple(names)
