"""Scoped overrides of the registry for ``kernelize``: per op, a version, a local build, or off.

    with kernel_mapping({"rmsnorm": "off"}):               # leave RMSNorm layers stock
    with kernel_mapping({"RMSNorm": ">=1.1,<2"}):          # a hub build: range, "1.1.0" or 1
    with kernel_mapping({"rmsnorm": Path("build/dev")}):   # a kernel directory (kernel.yaml + code)

A layer name stands for the op providing it. Versions and directories are passed to ``get_kernel``
as ``version=`` (a hub build) and ``local_dir=``.

Overrides live in a ``ContextVar``, so they follow threads and asyncio tasks and end with the
``with`` block. Nested blocks add to the outer ones; for one op the innermost entry wins.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path

from packaging.specifiers import SpecifierSet

from kernel_hub.errors import KernelHubError, UnknownNameError
from kernel_hub.hub.versions import parse_range
from kernel_hub.registry.registry import Registry

OFF = "off"


@dataclass(frozen=True)
class Override:
    """What one mapping entry asks for an op: exactly one of off, a version range, a directory."""

    key: str
    """The op, alias or layer name as written in the mapping."""
    off: bool = False
    version: SpecifierSet | None = None
    kernel_dir: Path | None = None

    def describe(self) -> str:
        if self.off:
            return f"kernel_mapping sets {self.key!r} off"
        if self.kernel_dir is not None:
            return f"kernel_mapping: {self.key!r} from {self.kernel_dir}"
        return f"kernel_mapping: {self.key!r} version {self.version}"


_ACTIVE: ContextVar[tuple[Override, ...]] = ContextVar("kernel_hub_mapping", default=())


def parse_override(key: str, value: str | int | Path) -> Override:
    """``"off"``; a version range (``">=1.1,<2"``), exact version (``"1.1.0"``) or major version
    (``1``); or a kernel directory (a ``Path``, or a string naming an existing directory)."""
    if not isinstance(key, str) or not key:
        raise KernelHubError(f"kernel_mapping keys are op or layer names, got {key!r}")
    if isinstance(value, Path):
        return Override(key, kernel_dir=_existing_dir(key, value))
    if isinstance(value, int) and not isinstance(value, bool):
        return Override(key, version=parse_range(value))
    if not isinstance(value, str):
        raise KernelHubError(
            f"kernel_mapping[{key!r}]: expected 'off', a version or a kernel directory, "
            f"got {type(value).__name__} {value!r}"
        )
    if value.strip().lower() == OFF:
        return Override(key, off=True)
    try:
        return Override(key, version=parse_range(value))
    except KernelHubError:
        pass
    if Path(value).expanduser().is_dir():
        return Override(key, kernel_dir=Path(value).expanduser())
    raise KernelHubError(
        f"kernel_mapping[{key!r}] = {value!r} is neither 'off', a version (e.g. '1.1.0', "
        "'>=1.1,<2' or 1) nor an existing kernel directory"
    )


def _existing_dir(key: str, path: Path) -> Path:
    path = path.expanduser()
    if not path.is_dir():
        raise KernelHubError(f"kernel_mapping[{key!r}]: {path} is not a directory")
    return path


@contextlib.contextmanager
def kernel_mapping(mapping: Mapping[str, str | Path]) -> Iterator[None]:
    """Override how ops are resolved by ``kernelize`` inside the ``with`` block."""
    if not isinstance(mapping, Mapping):
        raise KernelHubError(
            f"kernel_mapping takes a mapping of op or layer name -> 'off' | version | directory, "
            f"got {type(mapping).__name__}"
        )
    parsed = tuple(parse_override(key, value) for key, value in mapping.items())
    token = _ACTIVE.set(_ACTIVE.get() + parsed)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active_overrides(registry: Registry) -> dict[str, Override]:
    """The overrides in force, keyed by canonical op name; an unknown key is an error."""
    resolved: dict[str, Override] = {}
    for override in _ACTIVE.get():
        resolved[_op_for_key(registry, override.key)] = override
    return resolved


def _op_for_key(registry: Registry, key: str) -> str:
    if key in registry:
        return registry.get(key).name
    for entry in registry:
        if key in entry.layers:
            return entry.name
    valid = [name for entry in registry for name in (entry.name, *entry.aliases, *entry.layers)]
    raise UnknownNameError("kernel_mapping key", key, valid)
