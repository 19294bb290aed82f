"""``kernel-hub.lock``: every hub op pinned to a commit and the digests of all its files.

    {
      "kernel-hub-lock": 1,
      "ops": {
        "rmsnorm": {
          "repo": "kernel-hub/rmsnorm", "version": "1.0.0", "commit": "<40 hex>",
          "variants": {"torch-cpu": {"metadata.json": "<base64 sha256>", "rmsnorm/api.py": "..."}}
        }
      }
    }

Unlike the digest inside metadata.json, a lock covers metadata.json too, so a build whose bytes
differ in any file from what was locked is refused.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from packaging.version import InvalidVersion, Version

from kernel_hub.errors import IntegrityError, SourceError

from . import settings
from .digests import check_relative_name
from .json_source import field_line, load_json

LOCK_FORMAT = 1
COMMIT = re.compile(r"^[0-9a-f]{40}$")


@dataclass(frozen=True)
class LockedOp:
    op: str
    repo: str
    version: Version
    commit: str
    variants: Mapping[str, Mapping[str, str]]
    """Variant -> relative file path -> base64 sha256 (metadata.json included)."""
    explicit: bool = False
    """Named by the user (``lock=PATH``, ``$KERNEL_HUB_LOCK``), not found in the working
    directory: only then may it pin a version outside the registry's range."""

    def to_json(self) -> dict:
        return {
            "repo": self.repo,
            "version": str(self.version),
            "commit": self.commit,
            "variants": {
                v: dict(sorted(files.items())) for v, files in sorted(self.variants.items())
            },
        }


@dataclass(frozen=True)
class LockFile:
    path: Path
    ops: Mapping[str, LockedOp]


def write_lock(path: str | Path, ops: Mapping[str, LockedOp]) -> LockFile:
    """Write atomically (temporary file + rename)."""
    path = Path(path)
    data = {"kernel-hub-lock": LOCK_FORMAT, "ops": {op: ops[op].to_json() for op in sorted(ops)}}
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(json.dumps(data, indent=2) + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return LockFile(path=path, ops=dict(ops))


def read_lock(path: str | Path, text: str | None = None) -> LockFile:
    """Parse a lock file; malformed content raises ``SourceError`` with line and field."""
    path = Path(path)
    text, data = load_json(path, text, missing="lock file not found")
    if not isinstance(data, dict) or data.get("kernel-hub-lock") != LOCK_FORMAT:
        raise SourceError(
            path, 1, f'not a kernel-hub lock file (expected "kernel-hub-lock": {LOCK_FORMAT})'
        )
    ops_node = data.get("ops")
    if not isinstance(ops_node, dict):
        raise SourceError(
            path, field_line(text, "ops"), "'ops' must be a mapping of op name to its pin"
        )
    return LockFile(
        path=path, ops={op: _parse_op(path, text, op, node) for op, node in ops_node.items()}
    )


def _parse_op(path: Path, text: str, op: str, node: object) -> LockedOp:
    def fail(message: str, field: str | None = None) -> SourceError:
        line = field_line(text, field, after=op) if field else field_line(text, op)
        return SourceError(path, line, f"op {op!r}: {message}")

    if not isinstance(node, dict):
        raise fail("expected a mapping")
    repo, commit = node.get("repo"), node.get("commit")
    if not isinstance(repo, str) or repo.count("/") != 1:
        raise fail(f"'repo' must be 'org/name', got {repo!r}", "repo")
    if not isinstance(commit, str) or not COMMIT.match(commit):
        raise fail(f"'commit' must be a full 40-hex commit id, got {commit!r}", "commit")
    try:
        version = Version(node["version"]) if isinstance(node.get("version"), str) else None
    except InvalidVersion:
        version = None
    if version is None:
        raise fail(f"'version' is not a version: {node.get('version')!r}", "version")
    variants = node.get("variants")
    if not isinstance(variants, dict) or not variants:
        raise fail("'variants' must map variant names to file digests", "variants")
    for variant, files in variants.items():
        if not isinstance(files, dict) or not all(isinstance(d, str) for d in files.values()):
            raise fail(f"variant {variant!r}: expected file name -> digest", variant)
        for name in files:
            try:
                check_relative_name(name, f"build/{variant}")
            except IntegrityError as exc:
                raise fail(f"variant {variant!r}: {exc}", name) from None
    return LockedOp(op=op, repo=repo, version=version, commit=commit, variants=variants)


def find_lock(lock: str | Path | bool | None = None) -> LockFile | None:
    """The lock to honour: ``lock`` if a path, none if False.

    None (or True) means ``$KERNEL_HUB_LOCK``, else ``./kernel-hub.lock`` when present; True
    insists that one exists. A lock named by path or ``$KERNEL_HUB_LOCK`` is explicit; one
    found in the working directory must stay inside the registry's version range.
    """
    if lock is False:
        return None
    path = settings.lock_path() if lock is None or lock is True else Path(lock)
    if path is None:
        if lock is True:
            raise SourceError(Path.cwd() / settings.LOCK_FILE_NAME, None, "lock file not found")
        return None
    found = read_lock(path)
    if isinstance(lock, (str, os.PathLike)) or settings.lock_named():
        found = LockFile(found.path, {o: replace(p, explicit=True) for o, p in found.ops.items()})
    return found
