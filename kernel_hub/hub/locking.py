"""``kernel-hub lock``: pin every hub op of the registry to a commit and its files' digests.

Every variant of the resolved commit is downloaded and checked against its own metadata digest;
the lock then records the digest of every file as found (metadata.json included).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from kernel_hub.errors import IntegrityError
from kernel_hub.registry.publisher_keys import PublisherKeys
from kernel_hub.registry.registry import OpEntry, Registry

from .fetch import HubRequest, fetch_all_variants, require_keys, resolve_online
from .lockfile import LockedOp, LockFile, write_lock


@dataclass(frozen=True)
class LockResult:
    lock: LockFile
    skipped: dict[str, str]
    """Op -> why it was not locked (no hub repo)."""


def lock_registry(
    registry: Registry, path: str | Path, ops: Iterable[str] | None = None
) -> LockResult:
    entries = [registry.get(op) for op in ops] if ops is not None else list(registry)
    locked: dict[str, LockedOp] = {}
    skipped: dict[str, str] = {}
    for entry in entries:
        if entry.repo is None:
            skipped[entry.name] = "no 'repo' in the registry: in-tree only"
            continue
        locked[entry.name] = lock_op(entry, HubRequest.for_op(entry), registry.keys_for(entry.repo))
    return LockResult(write_lock(path, locked), skipped)


def lock_op(entry: OpEntry, request: HubRequest, keys: PublisherKeys | None) -> LockedOp:
    what = f"locking op {entry.name}"
    keys = require_keys(request.repo, keys, what)
    resolved = resolve_online(request, what)
    builds = fetch_all_variants(request.repo, resolved, keys, what)
    versions = {b.metadata.version for b in builds.values()}
    if len(versions) != 1:
        raise IntegrityError(
            f"{what}: the variants of {request.repo} at {resolved.commit[:12]} disagree on the "
            f"version ({', '.join(sorted(map(str, versions))) or 'no variants'})"
        )
    files = {v: dict(b.digests) for v, b in builds.items()}  # exactly what was verified
    return LockedOp(entry.name, request.repo, versions.pop(), resolved.commit, files)
