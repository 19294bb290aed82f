"""kernel-hub's caches in the user's cache directory: where each one lives, whether it is
switched off, and one warning per cache that cannot be used.

The bridge's compilation cache and model-bench's figure cache follow one convention, kept here:
``$<NAME>_DIR`` moves a cache, ``$<NAME>=0`` (or ``off``/``false``/``no``) switches it off, and
by default it lives in ``$XDG_CACHE_HOME/kernel-hub/<folder>`` (``~/.cache`` without it).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Hashable
from pathlib import Path

OFF_VALUES = ("0", "off", "false", "no")
_warned: set[Hashable] = set()


def is_switched_off(enable_env: str) -> bool:
    """Whether ``$enable_env`` switches a cache off."""
    return os.environ.get(enable_env, "1").strip().lower() in OFF_VALUES


def user_cache_dir(folder: str, enable_env: str, dir_env: str) -> Path | None:
    """``$dir_env``, else ``folder`` in kernel-hub's user cache; None when ``$enable_env``
    switches the cache off."""
    if is_switched_off(enable_env):
        return None
    configured = os.environ.get(dir_env)
    if configured:
        return Path(configured).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kernel-hub" / folder


def warn_once(key: Hashable, message: str, *, stacklevel: int = 2) -> None:
    """``message`` as a RuntimeWarning, once per ``key`` (a cache and its directory) and
    process: a cache that is silently not written looks like a slow machine. ``stacklevel``
    counts from the caller, as ``warnings.warn``'s does."""
    if key in _warned:
        return
    _warned.add(key)
    warnings.warn(message, RuntimeWarning, stacklevel=stacklevel + 1)
