"""``get_kernel``: op name -> registry entry -> a kernel build on disk -> loaded module."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from .errors import KernelHubError
from .loader import load_kernel_dir
from .paths import kernels_dir
from .registry import OpEntry, load_registry


def in_tree_dir(entry: OpEntry) -> Path:
    """The in-tree build of an op (``kernels/<kernel>``)."""
    return kernels_dir() / entry.kernel


def get_kernel(name: str, *, registry: str | Path | None = None) -> ModuleType:
    """Load the kernel that provides op ``name`` (or an alias) and return its module.

    The module exposes the torch ops, ``.jax`` (the JAX functions), ``.layers`` and ``.manifest``.
    Its implementation order per platform is set from the registry entry.
    """
    entry = load_registry(registry).get(name)
    module = load_kernel_dir(in_tree_dir(entry))
    _check_version(entry, module)
    _apply_implementation_order(entry, module)
    return module


def _check_version(entry: OpEntry, module: ModuleType) -> None:
    version = module.manifest.version
    if not entry.version.contains(version, prereleases=True):
        raise KernelHubError(
            f"op {entry.name}: registry asks for version {entry.version} but "
            f"{in_tree_dir(entry)} holds {version}"
        )


def _apply_implementation_order(entry: OpEntry, module: ModuleType) -> None:
    for table in getattr(module, "implementation_tables", ()):
        for platform, names in entry.implementations.items():
            table.set_order(platform, [n for n in names if n in table.names])
