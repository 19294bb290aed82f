"""Figures of deviceless compiles kept across runs, so model-bench compiles a program once.

libtpu's compile-only client cannot load a serialized executable (``no_persistent_cache``), so
JAX's persistent cache cannot serve model-bench. What model-bench reads from a compiled program
is a handful of numbers (memory and cost analysis, loops, collectives), or libtpu's refusal when
the program does not fit: those are kept, one JSON file per program. The file is named by a
SHA-256 over the lowered program's text and everything else that decides the compile: the
target (generation, chips, mesh), the jax, jaxlib and libtpu versions, ``XLA_FLAGS`` and
``LIBTPU_INIT_ARGS``, and ``FORMAT``. A changed kernel, model, shape, flag or compiler is a new
program and compiles again; an identical one is read back instead of compiled (a table rerun,
or the stock side of a quantized cell, which is the bf16 cell's).

``KERNEL_HUB_FIGURE_CACHE_DIR`` moves the cache (default ``$XDG_CACHE_HOME/kernel-hub/
model-bench`` or ``~/.cache/kernel-hub/model-bench``); ``KERNEL_HUB_FIGURE_CACHE=0`` (or
``off``/``false``/``no``) switches it off, as does ``kernel-hub model-bench --figure-cache off``.
An entry is written to a temporary file and renamed into place, so a reader never sees half of
one; an entry that does not read back as the expected figures is compiled again and replaced.
The cache is used only in a directory no other user can write (``user_cache.others_can_write``):
an entry planted there would be reported as the compiler's figures.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass, fields
from importlib import metadata
from pathlib import Path
from typing import Any

from kernel_hub.user_cache import make_private_dir, others_can_write, user_cache_dir, warn_once

from .mesh_compile import count_collectives
from .model_figures import ProgramFigures, has_loops, program_figures
from .overflow import memory_overflow

ENABLE_ENV = "KERNEL_HUB_FIGURE_CACHE"
DIR_ENV = "KERNEL_HUB_FIGURE_CACHE_DIR"
FORMAT = 1
"""Part of every key: raise it when what an entry holds, or how it is read from a compiled
program, changes (older entries are then never read)."""
_COMPILER_PACKAGES = ("jax", "jaxlib", "libtpu")
_COMPILER_ENV = ("XLA_FLAGS", "LIBTPU_INIT_ARGS")
_FIGURE_NAMES = tuple(f.name for f in fields(ProgramFigures) if f.name != "min_bytes_correction")


class CompileRefused(RuntimeError):
    """libtpu's refusal of a program (it does not fit a memory), read back from the cache: the
    message is libtpu's own, so callers read it as they read the compile's exception."""


@dataclass(frozen=True)
class CompiledFigures:
    """What model-bench reads from one compiled program."""

    figures: ProgramFigures
    """``min_bytes_correction`` is 0: it comes from the traced step, not the compile."""
    loops: bool
    collectives: dict[str, int]
    """``count_collectives`` of the compiled HLO, Mosaic kernels included."""


def default_cache_dir() -> Path | None:
    """Where figures are kept (``KERNEL_HUB_FIGURE_CACHE_DIR``, else the user cache), or None
    when ``KERNEL_HUB_FIGURE_CACHE`` switches the cache off."""
    return user_cache_dir("model-bench", ENABLE_ENV, DIR_ENV)


def program_key(program_text: str, target: str) -> str:
    """SHA-256 over the lowered program, the target and the compiler that compiles it."""
    digest = hashlib.sha256()
    compiler = {name: _version(name) for name in _COMPILER_PACKAGES}
    compiler |= {name: os.environ.get(name, "") for name in _COMPILER_ENV}
    header = {"format": FORMAT, "target": target, "compiler": compiler}
    digest.update(json.dumps(header, sort_keys=True).encode())
    digest.update(b"\0")
    digest.update(program_text.encode())
    return digest.hexdigest()


def compile_figures(lowered: Any, target: str, cache_dir: Path | None) -> CompiledFigures:
    """``lowered.compile()``'s figures, read from ``cache_dir`` when this program was compiled
    for ``target`` before (None: always compile, keep nothing). A memory refusal is kept too and
    raised again as ``CompileRefused`` with libtpu's message."""
    if cache_dir is not None:
        cache_dir = _usable(cache_dir)
    if cache_dir is None:
        return _figures_of(lowered.compile())
    key = program_key(lowered.as_text(), target)
    entry = _read(cache_dir / f"{key}.json", key)
    if entry is not None:
        if "refused" in entry:
            raise CompileRefused(entry["refused"])
        return _from_entry(entry)
    try:
        compiled = lowered.compile()
    except Exception as exc:  # libtpu's refusal is a JaxRuntimeError: read its message
        if memory_overflow(str(exc)) is not None:
            _write(cache_dir, key, {"refused": str(exc)})
        raise
    result = _figures_of(compiled)
    _write(cache_dir, key, _to_entry(result))
    return result


def _usable(cache_dir: Path) -> Path | None:
    """``cache_dir`` (made if missing, for this user alone), or None, said once, where figures
    cannot be kept: an entry someone else could plant there would be reported as libtpu's."""
    try:
        make_private_dir(cache_dir)
        problem = others_can_write(cache_dir)
    except OSError as exc:
        problem = f"it cannot be created ({exc.strerror or exc})"
    if problem is None:
        return cache_dir
    warn_once(
        ("figure cache", cache_dir),
        f"model-bench's figure cache {cache_dir} is not used: {problem}. Every run compiles "
        f"every program again. Set {DIR_ENV} to a directory only you can write, or "
        f"{ENABLE_ENV}=0 to switch the cache off without this warning.",
        stacklevel=3,
    )
    return None


def _figures_of(compiled: Any) -> CompiledFigures:
    hlo = compiled.as_text() or ""
    return CompiledFigures(program_figures(compiled), has_loops(hlo), count_collectives(hlo))


def _to_entry(result: CompiledFigures) -> dict[str, Any]:
    figures = {name: getattr(result.figures, name) for name in _FIGURE_NAMES}
    return {"figures": figures, "loops": result.loops, "collectives": result.collectives}


def _from_entry(entry: dict[str, Any]) -> CompiledFigures:
    figures = ProgramFigures(**{name: float(entry["figures"][name]) for name in _FIGURE_NAMES})
    return CompiledFigures(figures, entry["loops"], dict(entry["collectives"]))


def _valid(entry: Any, key: str) -> bool:
    """An entry this version wrote for ``key``: a refusal message, or every figure a number."""
    if not isinstance(entry, dict) or entry.get("key") != key or entry.get("format") != FORMAT:
        return False
    if "refused" in entry:
        return isinstance(entry["refused"], str)
    figures, collectives = entry.get("figures"), entry.get("collectives")
    return (
        isinstance(figures, dict)
        and all(_is_number(figures.get(name)) for name in _FIGURE_NAMES)
        and isinstance(entry.get("loops"), bool)
        and isinstance(collectives, dict)
        and all(isinstance(k, str) and type(v) is int for k, v in collectives.items())
    )


def _is_number(value: Any) -> bool:
    return type(value) in (int, float)


def _read(path: Path, key: str) -> dict[str, Any] | None:
    try:
        entry = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return entry if _valid(entry, key) else None


def _write(cache_dir: Path, key: str, entry: dict[str, Any]) -> None:
    """Write ``entry`` whole or not at all: a temporary file in the directory, renamed."""
    text = json.dumps({"format": FORMAT, "key": key, **entry}, indent=1, sort_keys=True)
    temporary = None
    try:
        with tempfile.NamedTemporaryFile(
            "w", dir=cache_dir, prefix=f".{key[:16]}-", suffix=".tmp", delete=False
        ) as handle:
            temporary = Path(handle.name)
            handle.write(text)
        os.replace(temporary, cache_dir / f"{key}.json")
    except OSError as exc:
        if temporary is not None:
            with contextlib.suppress(OSError):
                temporary.unlink()
        warn_once(
            ("figure cache", cache_dir),
            f"model-bench's figure cache {cache_dir} is not written ({exc.strerror or exc}): "
            f"every run compiles every program again. Set {DIR_ENV} to a directory only you can "
            f"write, or {ENABLE_ENV}=0 to switch the cache off without this warning.",
            stacklevel=3,
        )


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "none"
