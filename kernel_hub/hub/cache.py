"""kernel-hub's download cache: refs and verified snapshots of kernel repos, no network.

Layout, inside the Hugging Face cache folder and in ``huggingface_hub``'s naming::

    <cache>/kernels--<org>--<name>/refs/<ref>          a commit id, written after a build verified
    .../snapshots/<commit>/build/<variant>/...         regular files, moved in after verification
    .../snapshots/<commit>/signatures/<variant>.sig
    .../.staging-<random>/                             one private (0700) folder per fetch

Nothing enters ``snapshots/`` or ``refs/`` before it verified: downloads go to a staging folder
named by kernel-hub (never by the server), are checked there, and are moved in whole. Caches
written by earlier kernel-hub versions (through ``snapshot_download``) link snapshot files to
``blobs/<etag>``: they still verify and load; refusing one removes its own links and only the
blobs no other snapshot links to.

The cache may be shared with users who can write it (a team's ``HF_HOME``, a CI cache). Every
folder kernel-hub writes into, deletes from or creates is first checked by :func:`checked_dir`:
each component below the cache root a real directory (not a symlink) owned by this user, else a
``HubError`` and nothing is written or removed; none of them writable by its group or everyone
(made 0755, and a group-writable one left by a shared umask is tightened: only huggingface_hub's
shared ``.locks`` keep the umask), so a neighbour who can write the cache root cannot plant links
where kernel-hub reads or deletes. Files are created new (``O_EXCL``, no-follow) and
renamed into place, which replaces a planted link instead of following it. Stale staging folders
are removed only when they carry the marker this user's kernel-hub wrote into them.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import re
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from packaging.version import Version

from kernel_hub.errors import HubError

from . import settings
from .client import REPO_TYPE
from .digests import blob_link_target
from .lockfile import COMMIT
from .signing import signature_path
from .versions import version_of_tag

STAGING_PREFIX = ".staging-"
STAGING_MARKER = ".kernel-hub-staging"
STALE_STAGING_SECONDS = 24 * 3600
"""A staging folder this old belongs to no running fetch (downloads are bounded in size)."""
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
logger = logging.getLogger(__name__)
_private: tuple[int, Path] | None = None
_private_lock = threading.Lock()
_warned_writable: set[Path] = set()
SHARED_LOCKS = ".locks"
"""huggingface_hub's lock folders, shared with it for every repo: created with the user's umask."""
_REF = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]*(/[A-Za-z0-9_][A-Za-z0-9._-]*)*$")


def checked_dir(path: Path, *, create: bool = True) -> Path:
    """``path`` (inside the cache root), each component below the root a real directory owned by
    this user, created (one component at a time) when missing and ``create``; else a
    ``HubError``: a folder planted by someone else with write access is never followed."""
    root = settings.cache_dir()
    try:
        parts = path.relative_to(root).parts
    except ValueError:
        raise HubError(f"refusing {path}: it is not inside the cache {root}") from None
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise HubError(
            f"the Hugging Face cache {root} (HF_HUB_CACHE, else HF_HOME/hub) cannot be used: "
            f"{exc.strerror or exc}; point HF_HUB_CACHE at a directory you can write"
        ) from None
    _check_root(root)
    shared = bool(parts) and parts[0] == SHARED_LOCKS
    current = root
    for part in parts:
        current = current / part
        try:
            info = current.lstat()
        except FileNotFoundError:
            if not create:
                return path
            with contextlib.suppress(FileExistsError):
                current.mkdir(mode=0o777 if shared else 0o755)
            info = current.lstat()
        _check_own_dir(current, info)
        if not shared:
            _only_owner_writes(current, info)
    return path


def _only_owner_writes(folder: Path, info: os.stat_result) -> None:
    """Take write access to ``folder`` (this user's) from its group and everyone, where they have
    it: one made under a shared umask (002) would let a neighbour plant links where kernel-hub
    deletes and reads."""
    if not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return
    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _NOFOLLOW)
    try:
        os.fchmod(fd, stat.S_IMODE(info.st_mode) & ~(stat.S_IWGRP | stat.S_IWOTH))
    finally:
        os.close(fd)


def _check_own_dir(path: Path, info: os.stat_result) -> None:
    if stat.S_ISLNK(info.st_mode):
        target = os.readlink(path)
        raise HubError(
            f"refusing {path}: a symlink (to {target}) kernel-hub did not create, in the cache at "
            f"{settings.cache_dir()}; someone else with write access to the cache may have "
            "planted it. Remove it, or point HF_HUB_CACHE at a cache only you can write"
        )
    if not stat.S_ISDIR(info.st_mode):
        raise HubError(f"refusing {path}: not a directory (expected one kernel-hub created)")
    if info.st_uid != os.geteuid():
        raise HubError(
            f"refusing {path}: owned by user id {info.st_uid}, not this user ({os.geteuid()}); "
            "kernel-hub writes only into cache folders it created. Point HF_HUB_CACHE at a cache "
            "of your own"
        )


def _check_root(root: Path) -> None:
    """Warn once per cache when others can write it (they could plant files, which kernel-hub
    refuses, and delete builds, which it cannot prevent)."""
    try:
        mode = root.stat().st_mode
    except OSError:
        return
    if (
        mode & (stat.S_IWGRP | stat.S_IWOTH)
        and not mode & stat.S_ISVTX
        and root not in _warned_writable
    ):
        _warned_writable.add(root)
        logger.warning(
            "the Hugging Face cache %s is writable by its group or by everyone (mode %o): other "
            "users can delete or replace cached builds (kernel-hub refuses what they plant, but "
            "cannot keep them from deleting); use a cache only you can write (HF_HUB_CACHE)",
            root,
            stat.S_IMODE(mode),
        )


def repo_cache_dir(repo: str) -> Path:
    from huggingface_hub.file_download import repo_folder_name

    return settings.cache_dir() / repo_folder_name(repo_id=repo, repo_type=REPO_TYPE)


def snapshot_dir(repo: str, commit: str) -> Path:
    return repo_cache_dir(repo) / "snapshots" / commit


def cached_refs(repo: str) -> dict[str, str]:
    """Ref name -> commit for every ref of ``repo`` recorded in the cache (malformed ones are
    ignored: they can only come from outside kernel-hub)."""
    refs_dir = repo_cache_dir(repo) / "refs"
    if not refs_dir.is_dir() or refs_dir.is_symlink():
        return {}
    refs = {}
    for directory, _, files in os.walk(refs_dir, followlinks=False):
        for name in files:
            path = Path(directory, name)
            info = path.lstat()
            if stat.S_ISREG(info.st_mode) and info.st_size <= 64:
                commit = path.read_text(errors="replace").strip()
                if COMMIT.match(commit):
                    refs[path.relative_to(refs_dir).as_posix()] = commit
    return refs


def write_ref(repo: str, ref: str, commit: str) -> None:
    """Record that ``ref`` named ``commit`` (called only after a build of it verified)."""
    if not _REF.match(ref) or ".." in ref or not COMMIT.match(commit):
        raise HubError(f"refusing to record ref {ref!r} -> {commit!r} for {repo}")
    path = repo_cache_dir(repo) / "refs" / ref
    checked_dir(path.parent)
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
    return settings.cache_dir() / SHARED_LOCKS / repo_cache_dir(repo).name


def variant_lock(
    repo: str,
    commit: str,
    variant: str,
    *,
    timeout: float,
    expired: Callable[[str], Exception],
) -> contextlib.AbstractContextManager[None]:
    """Held while a variant is downloaded, verified or discarded, across threads and processes.

    Without it one fetcher could discard files another has just verified and is about to import,
    and every fetcher would download the same files at once.
    """
    return lock_file(
        locks_dir(repo) / "kernel-hub" / f"{commit}-{variant}.lock",
        timeout=timeout,
        expired=expired,
        waiting_for=f"another fetch of {repo} build/{variant}",
    )


@contextlib.contextmanager
def lock_file(
    path: Path, *, timeout: float, expired: Callable[[str], Exception], waiting_for: str
) -> Iterator[None]:
    """An inter-process lock at ``path`` (its folder checked); waiting longer than ``timeout``
    seconds raises ``expired("waiting for <waiting_for> (<path>)")``."""
    from filelock import FileLock, Timeout

    checked_dir(path.parent)
    lock = FileLock(path, timeout=timeout)
    try:
        lock.acquire()
    except Timeout:
        raise expired(f"waiting for {waiting_for} ({path})") from None
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
        _remove_ref(repo, ref)


def _remove_ref(repo: str, ref: str) -> None:
    path = repo_cache_dir(repo) / "refs" / ref
    checked_dir(path.parent, create=False)
    path.unlink(missing_ok=True)


@contextlib.contextmanager
def staging(repo: str) -> Iterator[Path]:
    """A new private folder (mode 0700) for one fetch, created atomically with a unique name on
    the cache's file system and marked as kernel-hub's; removed on exit whatever happened (what
    verified in it is moved out by :func:`install_variant` first)."""
    parent = checked_dir(repo_cache_dir(repo))
    _remove_stale_staging(parent)
    folder = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=parent))
    try:
        fd = os.open(
            folder / STAGING_MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600
        )
        os.close(fd)
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)  # fd-based: links inside are not followed


def _remove_stale_staging(parent: Path) -> None:
    """Staging folders left by a process killed while fetching: only real folders of this user
    holding kernel-hub's marker (a regular file of this user), older than a day."""
    for entry in parent.glob(f"{STAGING_PREFIX}*"):
        with contextlib.suppress(OSError):
            info = entry.lstat()
            marker = (entry / STAGING_MARKER).lstat()
            if (
                stat.S_ISDIR(info.st_mode)
                and info.st_uid == os.geteuid()
                and stat.S_ISREG(marker.st_mode)
                and marker.st_uid == os.geteuid()
                and time.time() - info.st_mtime > STALE_STAGING_SECONDS
            ):
                shutil.rmtree(entry, ignore_errors=True)


def install_variant(repo: str, commit: str, staged: Path, variant: str) -> None:
    """Move a verified variant (``staged/build/<variant>`` and its signature) into the snapshot.

    Called under ``variant_lock`` with nothing of the variant installed. The signature goes
    first: a variant folder without its signature is refused, never the other way round.
    """
    snapshot = snapshot_dir(repo, commit)
    checked_dir(snapshot / "build")
    checked_dir((snapshot / signature_path(variant)).parent)
    # its folders were made under the user's umask inside the private staging folder
    for directory, _, _ in os.walk(staged / "build" / variant, followlinks=False):
        _only_owner_writes(Path(directory), Path(directory).lstat())
    os.replace(staged / signature_path(variant), snapshot / signature_path(variant))
    os.rename(staged / "build" / variant, snapshot / "build" / variant)


def discard_variant(repo: str, commit: str, variant: str) -> None:
    """Remove a variant from the cache snapshot: its files, its signature, and, once no variant
    of the commit is left, the refs naming that commit.

    Called (under ``variant_lock``) when a cached variant did not verify, so nothing of it stays
    importable and the next attempt downloads it again. Nothing another snapshot uses is touched:
    of the blobs an older cache links to, only those no other snapshot links to are removed, and
    only from a ``blobs/`` folder of this user's (:func:`.digests.blob_link_target`: a link
    planted to lead elsewhere deletes nothing but itself).
    """
    snapshot = snapshot_dir(repo, commit)
    checked_dir(snapshot / "build", create=False)
    checked_dir((snapshot / signature_path(variant)).parent, create=False)
    folder = snapshot / "build" / variant
    signature = snapshot / signature_path(variant)
    links = [signature] if signature.is_symlink() else []
    if folder.is_dir() and not folder.is_symlink():
        links += _links_under(folder)
    blobs = repo_cache_dir(repo) / "blobs"
    own = {target for link in links if (target := blob_link_target(link, blobs)) is not None}
    signature.unlink(missing_ok=True)
    if folder.is_symlink() or folder.is_file():
        folder.unlink()
    else:
        shutil.rmtree(folder, ignore_errors=True)
    if own:
        checked_dir(blobs, create=False)
        for blob in own - _linked_blobs(repo):
            blob.unlink(missing_ok=True)
    if not cached_variants(repo, commit):
        for ref, target in cached_refs(repo).items():
            if target == commit:
                _remove_ref(repo, ref)


def _links_under(folder: Path) -> list[Path]:
    """Every symlink under ``folder``, without entering linked folders."""
    return [
        Path(directory, name)
        for directory, dirs, files in os.walk(folder, followlinks=False)
        for name in dirs + files
        if Path(directory, name).is_symlink()
    ]


def _linked_blobs(repo: str) -> set[Path]:
    """The blobs any snapshot of ``repo`` still links to."""
    snapshots = repo_cache_dir(repo) / "snapshots"
    if not snapshots.is_dir() or snapshots.is_symlink():
        return set()
    blobs = repo_cache_dir(repo) / "blobs"
    return {
        target
        for link in _links_under(snapshots)
        if (target := blob_link_target(link, blobs)) is not None
    }
