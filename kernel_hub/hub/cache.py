"""kernel-hub's view of the Hugging Face cache: refs and snapshots of kernel repos, no network.

Layout (``huggingface_hub``'s): ``<cache>/kernels--<org>--<name>/refs/<ref>`` holds a commit id,
``snapshots/<commit>/<path>`` links to ``blobs/<etag>``. Downloading with a tag or branch name
records that ref, which is what lets an offline process resolve a version range.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path

from packaging.version import Version

from . import settings
from .client import REPO_TYPE
from .signing import signature_path
from .versions import version_of_tag


def repo_cache_dir(repo: str) -> Path:
    from huggingface_hub.file_download import repo_folder_name

    return settings.cache_dir() / repo_folder_name(repo_id=repo, repo_type=REPO_TYPE)


def snapshot_dir(repo: str, commit: str) -> Path:
    return repo_cache_dir(repo) / "snapshots" / commit


def cached_refs(repo: str) -> dict[str, str]:
    """Ref name -> commit for every ref of ``repo`` recorded in the cache."""
    refs_dir = repo_cache_dir(repo) / "refs"
    if not refs_dir.is_dir():
        return {}
    return {
        path.relative_to(refs_dir).as_posix(): path.read_text().strip()
        for path in refs_dir.rglob("*")
        if path.is_file()
    }


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
def variant_lock(repo: str, commit: str, variant: str) -> Iterator[None]:
    """Held while a variant is downloaded, verified or discarded, across threads and processes.

    Without it one fetcher could discard files another has just verified and is about to import,
    and every fetcher would download the same files at once.
    """
    from filelock import FileLock

    path = locks_dir(repo) / "kernel-hub" / f"{commit}-{variant}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(path):
        yield


def discard_variant(repo: str, commit: str, variant: str) -> None:
    """Remove a variant's files from the cache snapshot, the blobs they link to, and partial
    downloads nobody is writing any more.

    Called (under ``variant_lock``) when a download failed or did not verify, so nothing of it
    stays importable and the next attempt downloads it again.
    """
    from filelock import FileLock, Timeout

    snapshot = snapshot_dir(repo, commit)
    folder = snapshot / "build" / variant
    blobs = (repo_cache_dir(repo) / "blobs").resolve()
    signature = snapshot / signature_path(variant)
    links = [signature] if signature.is_symlink() else []
    if folder.is_dir() and not folder.is_symlink():
        links += [link for link in folder.rglob("*") if link.is_symlink()]
    for link in links:
        target = link.resolve()
        if target.parent == blobs:
            target.unlink(missing_ok=True)
    signature.unlink(missing_ok=True)
    if folder.is_symlink():
        folder.unlink()
    else:
        shutil.rmtree(folder, ignore_errors=True)
    for partial in blobs.glob("*.incomplete") if blobs.is_dir() else ():
        # huggingface_hub writes blobs/<etag>[.<tag>].incomplete holding .locks/<repo>/<etag>.lock
        lock = FileLock(locks_dir(repo) / f"{partial.name.split('.', 1)[0]}.lock")
        try:
            with lock.acquire(timeout=0):
                partial.unlink(missing_ok=True)
        except Timeout:
            pass  # another download is writing it
