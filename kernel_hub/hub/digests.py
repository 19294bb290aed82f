"""Per-file sha256 digests of a build variant, and the checks run before its code is imported.

Digests use the format of Hugging Face ``kernels`` metadata (``{"algorithm": "sha256", "files":
{relative path: base64 sha256}}``) so both tools can check the same build. Like ``kernels``, the
digest in ``metadata.json`` covers every file of the variant except ``metadata.json`` itself (and
its signature); lock files add ``metadata.json``'s own digest, so a locked build is covered whole.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import re
import shutil
import stat
from collections.abc import Mapping
from pathlib import Path, PurePosixPath

from kernel_hub.errors import IntegrityError

ALGORITHM = "sha256"
METADATA_FILE = "metadata.json"
# Files the metadata digest leaves out (they describe the others). Bytecode is never in a build.
UNDIGESTED = frozenset({METADATA_FILE, f"{METADATA_FILE}.sigstore"})
BYTECODE_DIR = "__pycache__"
_DRIVE = re.compile(r"^[A-Za-z]:")


def file_digest(path: str | Path, copy_to: Path | None = None) -> str:
    """base64 sha256 of a file's bytes; with ``copy_to``, exactly the bytes hashed are written
    there too (one read: what was checked is what is used)."""
    sha = hashlib.sha256()
    with open(path, "rb") as f, open(copy_to, "xb") if copy_to else contextlib.nullcontext() as out:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            sha.update(chunk)
            if out is not None:
                out.write(chunk)
    return base64.b64encode(sha.digest()).decode("ascii")


def check_relative_name(name: str, inside: str) -> str:
    """``name`` if it is a plain relative path that stays inside ``inside``; else refuse it.

    Refuses absolute paths, ``..`` segments, backslashes, drive letters and empty segments: a build
    or lock file naming such a path would make kernel-hub read or write outside the build folder.
    """
    parts = name.split("/")
    if (
        not name
        or name.startswith("/")
        or "\\" in name
        or _DRIVE.match(name)
        or any(part in ("", ".", "..") for part in parts)
    ):
        raise IntegrityError(f"refusing file name {name!r}: it escapes {inside}")
    return str(PurePosixPath(*parts))


def hash_tree(
    root: str | Path, *, with_metadata: bool = False, copy_to: Path | None = None
) -> dict[str, str]:
    """Digest of every file under ``root`` (symlinks followed, bytecode caches skipped); with
    ``copy_to`` (a new folder), every file read is copied there from the bytes hashed."""
    root = Path(root)
    digests: dict[str, str] = {}
    for directory, dirs, files in os.walk(root, followlinks=False):
        dirs[:] = sorted(d for d in dirs if d != BYTECODE_DIR)
        for name in sorted(files):
            path = Path(directory, name)
            relative = path.relative_to(root).as_posix()
            if not with_metadata and relative in UNDIGESTED:
                continue
            target = None
            if copy_to is not None:
                target = copy_to / relative
                target.parent.mkdir(parents=True, exist_ok=True)
            digests[relative] = file_digest(path, target)
    return digests


def verify_tree(root: str | Path, expected: Mapping[str, str], *, label: str) -> None:
    """Raise ``IntegrityError`` naming every file of ``root`` that differs from ``expected``."""
    with_metadata = METADATA_FILE in expected
    compare_digests(hash_tree(root, with_metadata=with_metadata), expected, label=label)


def compare_digests(actual: Mapping[str, str], expected: Mapping[str, str], *, label: str) -> None:
    """Raise ``IntegrityError`` naming every file whose digest in ``actual`` (what is on disk)
    differs from ``expected``.

    ``label`` prefixes the file names in the message (e.g. ``build/torch-cpu``) so they read as
    repository paths. Files on disk that ``expected`` does not list are refused too (extra code is
    never imported silently); metadata.json counts only when ``expected`` lists it.
    """
    for name in expected:
        check_relative_name(name, label)
    if METADATA_FILE not in expected:
        actual = {n: d for n, d in actual.items() if n not in UNDIGESTED}
    changed = sorted(n for n in expected if n in actual and actual[n] != expected[n])
    missing = sorted(n for n in expected if n not in actual)
    unexpected = sorted(n for n in actual if n not in expected)
    problems = [
        f"{what}: {', '.join(f'{label}/{n}' for n in names)}"
        for what, names in (
            ("changed", changed),
            ("missing", missing),
            ("not in digest", unexpected),
        )
        if names
    ]
    if problems:
        raise IntegrityError(f"{label} does not match its digest; " + "; ".join(problems))


def blob_link_target(link: Path, blobs: Path | None) -> Path | None:
    """Where ``link`` points when it is an older cache's link to a regular file directly inside
    ``blobs``, a real folder (not a link); else None.

    Read from the link's text and the folders' own entries, never by resolving: a ``blobs``
    planted as a link (to a user's home, say) would otherwise make every link through it look
    like a blob, and discarding a refused build would delete what it points at."""
    if blobs is None:
        return None
    try:
        if not stat.S_ISDIR(blobs.lstat().st_mode):
            return None
        target = Path(os.path.normpath(link.parent / os.readlink(link)))
        if target.parent != Path(os.path.normpath(blobs)):
            return None
        return target if stat.S_ISREG(target.lstat().st_mode) else None
    except OSError:
        return None


def check_tree_shape(root: str | Path, *, label: str, links_into: Path | None = None) -> None:
    """Refuse anything in ``root`` but folders and regular files before its code is imported.

    Bytecode caches are deleted first (they are never part of a build, and Python would run a
    planted ``.pyc`` instead of the verified source). A symlink is allowed only when it is an
    older cache's link to a blob (:func:`blob_link_target`, ``links_into`` the ``blobs/``
    folder); a symlinked folder, a link out of the cache or a special file is refused, since
    digests are taken over the files a walk reaches and imports could reach others.
    """
    root = Path(root)
    if root.is_symlink():
        raise IntegrityError(f"refusing {label}: a symlink to {os.readlink(root)}")
    for directory, dirs, files in os.walk(root, followlinks=False):
        for name in [d for d in dirs if d == BYTECODE_DIR]:
            dirs.remove(name)
            _remove(Path(directory, name))
        for name in dirs + files:
            path = Path(directory, name)
            relative = f"{label}/{path.relative_to(root).as_posix()}"
            if path.is_symlink():
                if blob_link_target(path, links_into) is None:
                    raise IntegrityError(
                        f"refusing {relative}: a symlink to {os.readlink(path)}, outside the "
                        "build's files"
                    )
            elif name in files and not stat.S_ISREG(path.lstat().st_mode):
                raise IntegrityError(f"refusing {relative}: not a regular file")


def _remove(path: Path) -> None:
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)
