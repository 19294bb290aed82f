"""kernel-hub's caches in the user's cache directory: where each one lives, whether it is
switched off, whether only this user can write it, and one warning per cache that cannot be used.

The bridge's compilation cache and model-bench's figure cache follow one convention, kept here:
``$<NAME>_DIR`` moves a cache, ``$<NAME>=0`` (or ``off``/``false``/``no``) switches it off, and
by default it lives in ``$XDG_CACHE_HOME/kernel-hub/<folder>`` (``~/.cache`` without it). Their
entries are used as they are read (an executable is loaded and run, a figure is reported), with
nothing to verify them against, so each cache is used only in a directory no one else can write
(``others_can_write``): a neighbour who could plant an entry would choose the code or the
figures.
"""

from __future__ import annotations

import os
import stat
import warnings
from collections.abc import Hashable
from pathlib import Path

_OFF_VALUES = ("0", "off", "false", "no")
_warned: set[Hashable] = set()


def user_cache_dir(folder: str, enable_env: str, dir_env: str) -> Path | None:
    """``$dir_env``, else ``folder`` in kernel-hub's user cache; None when ``$enable_env``
    switches the cache off."""
    if os.environ.get(enable_env, "1").strip().lower() in _OFF_VALUES:
        return None
    configured = os.environ.get(dir_env)
    if configured:
        return Path(configured).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kernel-hub" / folder


def make_private_dir(directory: Path) -> None:
    """``directory`` and its missing parents, the last one readable and writable by this user
    alone (an existing one keeps its mode). Raises OSError."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)


def others_can_write(directory: Path) -> str | None:
    """Why someone other than this user could put files in ``directory`` (it belongs to another
    user, or its group or everyone may write it), or None. A sticky directory (``/tmp``) counts:
    others cannot delete an entry there, but they can write one first."""
    if not hasattr(os, "geteuid"):  # no POSIX owners and modes (Windows): nothing to check
        return None
    info = directory.stat()
    if info.st_uid != os.geteuid():
        return f"it belongs to user id {info.st_uid}, not to this user ({os.geteuid()})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"others can write it (mode {stat.S_IMODE(info.st_mode):o}; chmod go-w fixes that)"
    return None


def warn_once(key: Hashable, message: str, *, stacklevel: int = 2) -> None:
    """``message`` as a RuntimeWarning, once per ``key`` (a cache and its directory) and
    process: a cache that is silently not written looks like a slow machine. ``stacklevel``
    counts from the caller, as ``warnings.warn``'s does."""
    if key in _warned:
        return
    _warned.add(key)
    warnings.warn(message, RuntimeWarning, stacklevel=stacklevel + 1)
