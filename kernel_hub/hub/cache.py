"""kernel-hub's view of the Hugging Face cache: refs and snapshots of kernel repos, no network.

Layout (``huggingface_hub``'s): ``<cache>/kernels--<org>--<name>/refs/<ref>`` holds a commit id,
``snapshots/<commit>/<path>`` links to ``blobs/<etag>``. Downloading with a tag or branch name
records that ref, which is what lets an offline process resolve a version range.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from packaging.version import Version

from . import settings
from .client import REPO_TYPE
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


def discard_variant(repo: str, commit: str, variant: str) -> None:
    """Remove a variant's files from the cache snapshot and the blobs they link to.

    Called when a download failed or did not verify, so nothing of it stays importable and the next
    attempt downloads it again.
    """
    folder = snapshot_dir(repo, commit) / "build" / variant
    blobs = (repo_cache_dir(repo) / "blobs").resolve()
    if folder.is_dir():
        for link in folder.rglob("*"):
            if link.is_symlink():
                target = link.resolve()
                if target.parent == blobs:
                    target.unlink(missing_ok=True)
        shutil.rmtree(folder, ignore_errors=True)
    for partial in blobs.glob("*.incomplete") if blobs.is_dir() else ():
        partial.unlink(missing_ok=True)
