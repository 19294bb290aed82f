"""JAX's persistent compilation cache for the bridge's own compiles, on by default.

A fresh process then loads a kernel's executables from disk instead of compiling them again
(tracing and lowering still run). The cache is switched on only inside ``persistent_cache()``,
around the bridge's compiles for local devices, never globally: the user's own JAX compiles keep
their settings, and deviceless TPU compiles (which cannot be read back from the cache) are never
written to it.

``KERNEL_HUB_COMPILATION_CACHE=0`` (or ``off``/``false``) switches it off;
``KERNEL_HUB_COMPILATION_CACHE_DIR`` moves it (default: ``$XDG_CACHE_HOME/kernel-hub/jax`` or
``~/.cache/kernel-hub/jax``); ``set_compilation_cache_dir()`` does either from Python. A directory
the user set with ``jax_compilation_cache_dir`` is used as it is. JAX opens its cache once per
process, at the first compile that uses it: change the directory before that. JAX runs a cached
executable as it reads it, so kernel-hub's own directory is used only where no other user can
write (made for this user alone when missing); elsewhere the cache is off, with a warning.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path

from kernel_hub.user_cache import make_private_dir, others_can_write, user_cache_dir, warn_once

log = logging.getLogger(__name__)

ENABLE_ENV = "KERNEL_HUB_COMPILATION_CACHE"
DIR_ENV = "KERNEL_HUB_COMPILATION_CACHE_DIR"

_UNSET = object()
_override: object = _UNSET  # set_compilation_cache_dir() value: a Path, None (off) or unset


def set_compilation_cache_dir(directory: str | os.PathLike | None) -> None:
    """Use ``directory`` for the bridge's compilation cache; None switches the cache off."""
    global _override
    _override = None if directory is None else Path(directory)


def compilation_cache_dir() -> Path | None:
    """Where the bridge's executables are cached, or None when the cache is off."""
    if _override is not _UNSET:
        return _override  # type: ignore[return-value]
    return user_cache_dir("jax", ENABLE_ENV, DIR_ENV)


@contextlib.contextmanager
def persistent_cache() -> Iterator[None]:
    """Compiles inside this block read and write the persistent cache (every entry, however
    fast it compiled). Nothing changes when the cache is off.

    JAX opens its cache at the first compile that finds a directory configured and then serves
    every later compile in the process from it, whatever the configuration says by then. So when
    the directory is kernel-hub's own, the cache is closed again on the way out: compiles outside
    this block (the user's, deviceless TPU compiles) never read or write it. A directory the user
    configured for JAX stays theirs: it is used, and left open, as JAX would.
    """
    import jax

    directory = compilation_cache_dir()
    if directory is None or not jax.config.jax_enable_compilation_cache:
        yield
        return
    try:
        from jax._src import compilation_cache as jax_cache
        from jax._src import config as jax_config

        settings = [
            jax_config.persistent_cache_min_compile_time_secs(0),
            jax_config.persistent_cache_min_entry_size_bytes(-1),
        ]
        own_directory = jax.config.jax_compilation_cache_dir is None
        close = jax_cache.reset_cache
    except (ImportError, AttributeError, TypeError) as exc:  # JAX's internals moved
        log.debug("persistent compilation cache not used: %s", exc)
        yield
        return
    if own_directory:
        problem = _unusable(directory)
        if problem is not None:
            warn_once(
                ("compilation cache", directory),
                f"kernel-hub's compilation cache {directory} is not used: {problem}. Kernels are "
                f"compiled again in every process. Set {DIR_ENV} to a directory only you can "
                f"write, or {ENABLE_ENV}=0 to switch the cache off without this warning.",
                stacklevel=3,
            )
            yield
            return
        settings.append(jax_config.compilation_cache_dir(str(directory)))
    with contextlib.ExitStack() as stack:
        if own_directory:
            stack.callback(close)
        for setting in settings:
            stack.enter_context(setting)
        yield


def _unusable(directory: Path) -> str | None:
    """Why the cache cannot be kept in ``directory`` (made if missing, for this user alone), or
    None. JAX loads a cached executable without checking it: a directory someone else can write
    would let them choose the code a kernel runs."""
    try:
        make_private_dir(directory)
        if not os.access(directory, os.W_OK | os.X_OK):
            return "it is not writable"
        return others_can_write(directory)
    except OSError as exc:
        return f"it cannot be created ({exc.strerror or exc})"
