"""A directory of hub repos: what ``kernel-hub mirror`` writes and ``kernel-hub serve`` serves.

    DIR/kernel-hub-store.json             {"kernel-hub-store": 1}
    DIR/blobs/<sha256 hex>                file contents, shared by all repos
    DIR/repos/<type>/<org>/<name>/refs.json        {"branches": {...}, "tags": {...}}
    DIR/repos/<type>/<org>/<name>/commits/<oid>.json
        {"oid", "parent", "message", "files": {path: {"sha256", "size", "oid"}}}

Blobs are named by their sha256 and checked against it when read, so a file changed on the
mirror's disk is served as an error, never as content. A commit is a whole snapshot (no
history is needed to serve one). Every write goes to a temporary file renamed into place, and
refs change under a lock shared by all processes using the directory, so a crash or a
concurrent writer never leaves a half-written commit or ref behind. Repo names become folder
names only after a strict check, and file paths never become file names at all.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kernel_hub.errors import KernelHubError

STORE_FORMAT = 1
MARKER = "kernel-hub-store.json"
REPO_TYPES = ("kernel", "model", "dataset", "space")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
_OID = re.compile(r"^[0-9a-f]{40}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class StoreError(KernelHubError, RuntimeError):
    """A request the store refuses; ``status`` is the HTTP status the server answers with."""

    def __init__(self, status: int, code: str | None, message: str):
        super().__init__(message)
        self.status, self.code = status, code


def git_blob_oid(data: bytes) -> str:
    """The git object id of a file, which the Hub reports as its ETag."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass(frozen=True)
class StoredFile:
    sha256: str
    size: int
    oid: str


@dataclass(frozen=True)
class Commit:
    oid: str
    parent: str | None
    message: str
    files: Mapping[str, StoredFile]

    def to_json(self) -> dict:
        return {
            "oid": self.oid,
            "parent": self.parent,
            "message": self.message,
            "files": {
                p: {"sha256": f.sha256, "size": f.size, "oid": f.oid}
                for p, f in sorted(self.files.items())
            },
        }


@dataclass(frozen=True)
class Refs:
    branches: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)


class RepoStore:
    """The repos in one directory (created on first use)."""

    def __init__(self, root: str | Path, *, create: bool = True):
        self.root = Path(root)
        marker = self.root / MARKER
        if not marker.is_file():
            if not create:
                raise KernelHubError(
                    f"{self.root} is not a kernel-hub store (no {MARKER}); "
                    "make one with 'kernel-hub mirror --to DIR' or by publishing to a server on it"
                )
            if self.root.exists() and any(self.root.iterdir()):
                raise KernelHubError(
                    f"{self.root} is neither empty nor a kernel-hub store (no {MARKER}); "
                    "refusing to write into it"
                )
            (self.root / "blobs").mkdir(parents=True, exist_ok=True)
            _write_atomic(marker, json.dumps({"kernel-hub-store": STORE_FORMAT}).encode())
        self._thread_lock = threading.RLock()

    # -- locking ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Held while refs or repos change: threads of this process and other processes."""
        from filelock import FileLock

        with self._thread_lock, FileLock(self.root / ".lock"):
            yield

    # -- names -----------------------------------------------------------------------------------
    def repo_dir(self, repo_type: str, repo_id: str) -> Path:
        if repo_type not in REPO_TYPES:
            raise StoreError(400, None, f"unknown repo type {repo_type!r}")
        parts = repo_id.split("/")
        if len(parts) != 2 or not all(_NAME.match(p) and p not in (".", "..") for p in parts):
            raise StoreError(400, None, f"invalid repo id {repo_id!r}; expected 'org/name'")
        return self.root / "repos" / repo_type / parts[0] / parts[1]

    def repos(self, repo_type: str = "kernel") -> list[str]:
        base = self.root / "repos" / repo_type
        if not base.is_dir():
            return []
        return sorted(f"{o.name}/{n.name}" for o in base.iterdir() for n in o.iterdir())

    # -- reading ---------------------------------------------------------------------------------
    def has_repo(self, repo_type: str, repo_id: str) -> bool:
        return (self.repo_dir(repo_type, repo_id) / "refs.json").is_file()

    def refs(self, repo_type: str, repo_id: str) -> Refs:
        path = self.repo_dir(repo_type, repo_id) / "refs.json"
        try:
            data = json.loads(path.read_bytes())
        except FileNotFoundError:
            raise StoreError(404, "RepoNotFound", f"Repository {repo_id} not found") from None
        return Refs(dict(data["branches"]), dict(data["tags"]))

    def commit(self, repo_type: str, repo_id: str, oid: str) -> Commit | None:
        if not _OID.match(oid):
            return None
        path = self.repo_dir(repo_type, repo_id) / "commits" / f"{oid}.json"
        try:
            data = json.loads(path.read_bytes())
        except FileNotFoundError:
            return None
        files = {p: StoredFile(f["sha256"], f["size"], f["oid"]) for p, f in data["files"].items()}
        return Commit(data["oid"], data["parent"], data["message"], files)

    def resolve(self, repo_type: str, repo_id: str, revision: str) -> Commit:
        """The commit a branch, tag or commit id names (404 ``RevisionNotFound`` otherwise)."""
        refs = self.refs(repo_type, repo_id)
        oid = refs.branches.get(revision) or refs.tags.get(revision) or revision
        commit = self.commit(repo_type, repo_id, oid)
        if commit is None:
            raise StoreError(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return commit

    def read_blob(self, stored: StoredFile) -> bytes:
        """A file's bytes, checked against its sha256 (a changed blob is an error, not data)."""
        if not _SHA256.match(stored.sha256):
            raise StoreError(500, None, f"corrupt store entry {stored.sha256!r}")
        try:
            data = (self.root / "blobs" / stored.sha256).read_bytes()
        except FileNotFoundError:
            raise StoreError(500, None, f"blob {stored.sha256} is missing from the store") from None
        if hashlib.sha256(data).hexdigest() != stored.sha256:
            raise StoreError(500, None, f"blob {stored.sha256} changed on disk; not serving it")
        return data

    # -- writing ---------------------------------------------------------------------------------
    def put_blob(self, data: bytes) -> StoredFile:
        sha = hashlib.sha256(data).hexdigest()
        path = self.root / "blobs" / sha
        if not path.is_file():
            _write_atomic(path, data)
        return StoredFile(sha, len(data), git_blob_oid(data))

    def create_repo(self, repo_type: str, repo_id: str) -> None:
        """A new repo whose ``main`` holds one empty commit, as on the Hub; 409 if it exists."""
        with self.locked():
            if self.has_repo(repo_type, repo_id):
                raise StoreError(409, None, f"You already created this {repo_type} repo")
            self._create(repo_type, repo_id)

    def ensure_repo(self, repo_type: str, repo_id: str) -> None:
        with self.locked():
            if not self.has_repo(repo_type, repo_id):
                self._create(repo_type, repo_id)

    def _create(self, repo_type: str, repo_id: str) -> None:
        initial = self.write_commit(repo_type, repo_id, _new_commit(None, "initial commit", {}))
        self._write_refs(repo_type, repo_id, Refs({"main": initial.oid}, {}))

    def write_commit(self, repo_type: str, repo_id: str, commit: Commit) -> Commit:
        """Store ``commit`` as is (a mirror keeps the upstream commit ids, so locks still match);
        its blobs must be in the store already."""
        if not _OID.match(commit.oid):
            raise StoreError(400, None, f"invalid commit id {commit.oid!r}")
        path = self.repo_dir(repo_type, repo_id) / "commits" / f"{commit.oid}.json"
        _write_atomic(path, json.dumps(commit.to_json(), indent=1).encode())
        return commit

    def commit_files(
        self,
        repo_type: str,
        repo_id: str,
        branch: str,
        *,
        added: Mapping[str, bytes | StoredFile],
        deleted: list[str],
        deleted_folders: list[str],
        message: str,
        parent: str | None,
    ) -> Commit:
        """A new commit on ``branch``: its head's files with these changes (the Hub's commit)."""
        with self.locked():
            refs = self.refs(repo_type, repo_id)
            if branch not in refs.branches:
                raise StoreError(404, "RevisionNotFound", f"Invalid rev id: {branch}")
            head = self.resolve(repo_type, repo_id, branch)
            if parent is not None and parent != head.oid:
                raise StoreError(412, None, f"parent commit {parent} is not the head of {branch}")
            files = dict(head.files)
            for path in deleted:
                if files.pop(path, None) is None:
                    raise StoreError(
                        404, "EntryNotFound", f"A file with this name doesn't exist: {path}"
                    )
            for folder in deleted_folders:
                prefix = folder.rstrip("/") + "/"
                files = {p: f for p, f in files.items() if not p.startswith(prefix)}
            for path, data in added.items():  # StoredFile: put by the caller already
                files[path] = data if isinstance(data, StoredFile) else self.put_blob(data)
            commit = self.write_commit(repo_type, repo_id, _new_commit(head.oid, message, files))
            refs.branches[branch] = commit.oid
            self._write_refs(repo_type, repo_id, refs)
            return commit

    def set_ref(
        self, repo_type: str, repo_id: str, kind: str, name: str, oid: str | None, *, create: bool
    ) -> None:
        """Point branch/tag ``name`` at ``oid`` (None deletes it). ``create``: 409 if it exists."""
        with self.locked():
            refs = self.refs(repo_type, repo_id)
            names = refs.branches if kind == "branch" else refs.tags
            if oid is None:
                if names.pop(name, None) is None:
                    raise StoreError(404, "RevisionNotFound", f"Invalid rev id: {name}")
            else:
                if create and name in names:
                    raise StoreError(409, None, f"{kind} {name} already exists")
                if self.commit(repo_type, repo_id, oid) is None:
                    raise StoreError(404, "RevisionNotFound", f"Invalid rev id: {oid}")
                names[name] = oid
            self._write_refs(repo_type, repo_id, refs)

    def _write_refs(self, repo_type: str, repo_id: str, refs: Refs) -> None:
        data = {
            "branches": dict(sorted(refs.branches.items())),
            "tags": dict(sorted(refs.tags.items())),
        }
        _write_atomic(self.repo_dir(repo_type, repo_id) / "refs.json", json.dumps(data).encode())


def _new_commit(parent: str | None, message: str, files: Mapping[str, StoredFile]) -> Commit:
    content = json.dumps(
        [parent, message, time.time_ns(), sorted((p, f.sha256) for p, f in files.items())]
    )
    return Commit(hashlib.sha1(content.encode()).hexdigest(), parent, message, dict(files))


def _write_atomic(path: Path, data: bytes) -> None:
    """Write to a temporary file beside ``path`` and rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
