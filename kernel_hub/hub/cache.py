"""kernel-hub's download cache: refs and verified snapshots of kernel repos, no network.

Layout, inside the Hugging Face cache folder and in ``huggingface_hub``'s naming::

    <cache>/kernels--<org>--<name>/refs/<ref>          a commit id, written after a build verified
    .../snapshots/<commit>/build/<variant>/...         regular files, moved in after verification
    .../snapshots/<commit>/signatures/<variant>.sig
    .../.staging/<random>/                             private (0700) download folders

Nothing enters ``snapshots/`` or ``refs/`` before it verified: downloads go to a staging folder
named by kernel-hub (never by the server), are checked there, and are moved in whole. Caches
written by earlier kernel-hub versions (through ``snapshot_download``) link snapshot files to
``blobs/<etag>``: they still verify and load; refusing one removes its own links and only the
blobs no other snapshot links to.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from packaging.version import Version

from kernel_hub.errors import HubError

from . import settings
from .client import REPO_TYPE
from .lockfile import COMMIT
from .signing import signature_path
from .versions import version_of_tag

STAGING = ".staging"
STALE_STAGING_SECONDS = 24 * 3600
"""A staging folder this old belongs to no running fetch (downloads are bounded in size)."""
_private: tuple[int, Path] | None = None
_private_lock = threading.Lock()
_REF = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]*(/[A-Za-z0-9_][A-Za-z0-9._-]*)*$")


def repo_cache_dir(repo: str) -> Path:
    from huggingface_hub.file_download import repo_folder_name

    return settings.cache_dir() / repo_folder_name(repo_id=repo, repo_type=REPO_TYPE)


def snapshot_dir(repo: str, commit: str) -> Path:
    return repo_cache_dir(repo) / "snapshots" / commit


def cached_refs(repo: str) -> dict[str, str]:
    """Ref name -> commit for every ref of ``repo`` recorded in the cache (malformed ones are
    ignored: they can only come from outside kernel-hub)."""
    refs_dir = repo_cache_dir(repo) / "refs"
    if not refs_dir.is_dir():
        return {}
    refs = {}
    for path in refs_dir.rglob("*"):
        if path.is_file() and not path.is_symlink() and path.stat().st_size <= 64:
            commit = path.read_text(errors="replace").strip()
            if COMMIT.match(commit):
                refs[path.relative_to(refs_dir).as_posix()] = commit
    return refs


def write_ref(repo: str, ref: str, commit: str) -> None:
    """Record that ``ref`` named ``commit`` (called only after a build of it verified)."""
    if not _REF.match(ref) or ".." in ref or not COMMIT.match(commit):
        raise HubError(f"refusing to record ref {ref!r} -> {commit!r} for {repo}")
    path = repo_cache_dir(repo) / "refs" / ref
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".ref-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(commit)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def cached_versions(repo: str) -> dict[Version, str]:
    """Version -> commit for the version tags whose snapshot holds at least one variant."""
    versions = {}
    for ref, commit in cached_refs(repo).items():
        version = version_of_tag(ref)
        if version is not None and cached_variants(repo, commit):
            versions[version] = commit
    return versions


def cached_variants(repo: str, commit: str) -> list[str]:
    build = snapshot_dir(repo, commit) / "build"
    return sorted(p.name for p in build.iterdir() if p.is_dir()) if build.is_dir() else []


def locks_dir(repo: str) -> Path:
    """Where ``huggingface_hub`` keeps the per-blob download locks of ``repo``."""
    return settings.cache_dir() / ".locks" / repo_cache_dir(repo).name


@contextlib.contextmanager
def variant_lock(
    repo: str,
    commit: str,
    variant: str,
    *,
    timeout: float,
    expired: Callable[[str], Exception],
) -> Iterator[None]:
    """Held while a variant is downloaded, verified or discarded, across threads and processes.

    Without it one fetcher could discard files another has just verified and is about to import,
    and every fetcher would download the same files at once. Waiting for it longer than
    ``timeout`` seconds raises ``expired(what)``.
    """
    from filelock import FileLock, Timeout

    path = locks_dir(repo) / "kernel-hub" / f"{commit}-{variant}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        lock = FileLock(path, timeout=timeout)
        lock.acquire()
    except Timeout:
        raise expired(f"waiting for another fetch of {repo} build/{variant} ({path})") from None
    try:
        yield
    finally:
        lock.release()


def verified_copy_dir(repo: str, commit: str, variant: str, metadata_digest: str) -> Path:
    """Where this process keeps its private copy of a verified variant, to import from.

    The copy is written from the very bytes that were hashed (:func:`.digests.hash_tree`), in a
    folder only this user can write, removed when the process exits; so what is imported is what
    was verified, whoever can write the shared cache. ``metadata_digest`` (hex) keys it to the
    exact build.
    """
    global _private
    with _private_lock:
        if _private is None or _private[0] != os.getpid() or not _private[1].is_dir():
            root = Path(tempfile.mkdtemp(prefix="kernel-hub-verified-"))
            _private = (os.getpid(), root)
            atexit.register(_remove_private, os.getpid(), root)
        root = _private[1]
    return (
        root
        / metadata_digest[:32]
        / repo_cache_dir(repo).name
        / "snapshots"
        / commit
        / "build"
        / variant
    )


def _remove_private(pid: int, root: Path) -> None:
    if os.getpid() == pid:  # not in a forked child that inherited the handler
        shutil.rmtree(root, ignore_errors=True)


def forget_ref(repo: str, ref: str, commit: str) -> None:
    """Remove ``ref`` if it still names ``commit`` (a ref that led to the wrong build)."""
    if cached_refs(repo).get(ref) == commit:
        (repo_cache_dir(repo) / "refs" / ref).unlink(missing_ok=True)


@contextlib.contextmanager
def staging(repo: str) -> Iterator[Path]:
    """A new private folder (mode 0700) on the cache's file system, removed on exit whatever
    happened; what verified in it is moved out by :func:`install_variant` first."""
    parent = repo_cache_dir(repo) / STAGING
    parent.mkdir(parents=True, exist_ok=True)
    for stale in parent.iterdir():  # left by a process killed while fetching
        with contextlib.suppress(OSError):
            if time.time() - stale.lstat().st_mtime > STALE_STAGING_SECONDS:
                shutil.rmtree(stale, ignore_errors=True)
    folder = Path(tempfile.mkdtemp(prefix="fetch-", dir=parent))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        with contextlib.suppress(OSError):
            parent.rmdir()  # only when no other fetch is staging


def install_variant(repo: str, commit: str, staged: Path, variant: str) -> None:
    """Move a verified variant (``staged/build/<variant>`` and its signature) into the snapshot.

    Called under ``variant_lock`` with nothing of the variant installed. The signature goes
    first: a variant folder without its signature is refused, never the other way round.
    """
    snapshot = snapshot_dir(repo, commit)
    (snapshot / "build").mkdir(parents=True, exist_ok=True)
    (snapshot / signature_path(variant)).parent.mkdir(parents=True, exist_ok=True)
    os.replace(staged / signature_path(variant), snapshot / signature_path(variant))
    os.rename(staged / "build" / variant, snapshot / "build" / variant)


def discard_variant(repo: str, commit: str, variant: str) -> None:
    """Remove a variant from the cache snapshot: its files, its signature, and, once no variant
    of the commit is left, the refs naming that commit.

    Called (under ``variant_lock``) when a cached variant did not verify, so nothing of it stays
    importable and the next attempt downloads it again. Nothing another snapshot uses is touched:
    of the blobs an older cache links to, only those no other snapshot links to are removed.
    """
    snapshot = snapshot_dir(repo, commit)
    folder = snapshot / "build" / variant
    signature = snapshot / signature_path(variant)
    links = [signature] if signature.is_symlink() else []
    if folder.is_dir() and not folder.is_symlink():
        links += [link for link in folder.rglob("*") if link.is_symlink()]
    blobs = (repo_cache_dir(repo) / "blobs").resolve()
    own = {target for link in links if (target := link.resolve()).parent == blobs}
    signature.unlink(missing_ok=True)
    if folder.is_symlink() or folder.is_file():
        folder.unlink()
    else:
        shutil.rmtree(folder, ignore_errors=True)
    for blob in own - _linked_blobs(repo):
        blob.unlink(missing_ok=True)
    if not cached_variants(repo, commit):
        for ref, target in cached_refs(repo).items():
            if target == commit:
                (repo_cache_dir(repo) / "refs" / ref).unlink(missing_ok=True)


def _linked_blobs(repo: str) -> set[Path]:
    """The blobs any snapshot of ``repo`` still links to."""
    snapshots = repo_cache_dir(repo) / "snapshots"
    if not snapshots.is_dir():
        return set()
    return {path.resolve() for path in snapshots.rglob("*") if path.is_symlink()}
