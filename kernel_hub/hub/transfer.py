"""kernel-hub's own file downloads, on :mod:`.network`'s bounded requests (timeouts, capped
retries, the fetch deadline), with nothing the server sends ever naming a path.

``huggingface_hub``'s ``snapshot_download`` names each blob after the server's ETag, so a hostile
hub could write anywhere the client can (a ``.pth`` into site-packages runs in every later
Python process). Here the caller names the destination, from a signed listing, and every
download stops at ``limit`` bytes; a file that must match a digest is hashed while it is
written and refused on mismatch. Only the URL comes from the repo path, and the path was checked
first (:func:`check_name`).
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
from collections.abc import Callable
from pathlib import Path

from kernel_hub.errors import IntegrityError

from . import network, settings
from .client import REPO_TYPE, hub_errors
from .digests import check_relative_name

MAX_SIGNATURE_BYTES = 64 * 1024
MAX_METADATA_BYTES = 1024 * 1024
"""metadata.json larger than this is refused before it is parsed (before its signature, too)."""
MAX_FILE_BYTES = 64 * 1024 * 1024
"""Per file, when the signed metadata records no size (builds made before sizes were signed)."""
MAX_VARIANT_BYTES = 256 * 1024 * 1024
"""All files of one variant together."""
_UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f]")


def check_name(name: str, inside: str) -> str:
    """``check_relative_name`` plus no NUL or control character (a clear ``IntegrityError``)."""
    if not isinstance(name, str) or _UNPRINTABLE.search(name):
        raise IntegrityError(f"refusing file name {name!r} in {inside}: a control character")
    return check_relative_name(name, inside)


def file_url(repo: str, commit: str, path: str) -> str:
    from huggingface_hub import hf_hub_url

    return hf_hub_url(
        repo, path, repo_type=REPO_TYPE, revision=commit, endpoint=settings.endpoint()
    )


def fetch_bytes(repo: str, commit: str, path: str, *, limit: int, where: str) -> bytes:
    """A small file (a signature, metadata.json) read into memory, at most ``limit`` bytes;
    ``where`` starts error messages."""
    chunks: list[bytes] = []
    _stream(repo, commit, path, limit, chunks.append, where, restart=chunks.clear)
    return b"".join(chunks)


def fetch_file(
    repo: str, commit: str, path: str, dest: Path, *, limit: int, digest: str, where: str
) -> int:
    """Download ``path`` to ``dest`` (a new file in a private staging folder), refusing more than
    ``limit`` bytes or content whose sha256 is not ``digest`` (``changed: PATH``); returns the
    size."""
    sha = [hashlib.sha256()]
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    with os.fdopen(fd, "wb") as f:

        def write(chunk: bytes) -> None:
            sha[0].update(chunk)
            f.write(chunk)

        def restart() -> None:
            f.seek(0)
            f.truncate()
            sha[0] = hashlib.sha256()

        size = _stream(repo, commit, path, limit, write, where, restart=restart)
    if base64.b64encode(sha[0].digest()).decode("ascii") != digest:
        raise IntegrityError(f"changed: {path} (not the bytes its signed digest names)")
    return size


def _stream(
    repo: str,
    commit: str,
    path: str,
    limit: int,
    sink: Callable[[bytes], None],
    where: str,
    *,
    restart: Callable[[], None],
) -> int:
    """GET the file at ``commit`` into ``sink``, at most ``limit`` bytes, through
    :func:`network.get` (timeouts, bounded retries from the start, the fetch deadline)."""
    size = 0

    def count(chunk: bytes) -> None:
        nonlocal size
        size += len(chunk)
        sink(chunk)

    def again() -> None:
        nonlocal size
        size = 0
        restart()

    with hub_errors(f"{where}: {path}"):
        network.get(
            file_url(repo, commit, path),
            f"{where}: {path}",
            limit=limit,
            sink=count,
            restart=again,
            download=True,
            too_large=lambda: IntegrityError(f"changed: {path} (over {limit} bytes)"),
        )
    return size
