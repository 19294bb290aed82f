"""Where the registry and the kernels live: a kernel project, the built-in ones, or env overrides.

In the repository, ``registry.yaml`` and ``kernels/`` sit at the top level beside ``kernel_hub/``;
the wheel ships the same files as the data directory ``kernel_hub/builtin/`` (pyproject's
package-dir mapping). An installed package finds them beside its own modules, a checkout (an
editable install, or ``PYTHONPATH`` pointing at it) one directory up.

A **kernel project** is a directory holding a ``registry.yaml`` and a ``kernels/`` folder (what
``kernel-hub new-kernel`` makes). Run from one, its registry is the default, as
``./kernel-hub.lock`` is; only the current directory is looked at, never its parents. A registry's
kernels are looked up in the ``kernels/`` folder beside it, then among the built-in ones.
"""

from __future__ import annotations

import os
from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent
REGISTRY_NAME = "registry.yaml"
KERNELS_NAME = "kernels"


def _builtin_dir() -> Path:
    shipped = _PACKAGE_DIR / "builtin"
    return shipped if (shipped / REGISTRY_NAME).is_file() else _PACKAGE_DIR.parent


BUILTIN_DIR = _builtin_dir()


def project_registry(directory: Path) -> Path | None:
    """``directory``'s registry if ``directory`` is a kernel project (registry.yaml + kernels/).

    kernel-hub's own source tree has that shape but is not a project: there the built-in registry
    applies (the checkout's when run from it, the wheel's when installed, so the test suite run
    from the checkout tests what was installed)."""
    registry = directory / REGISTRY_NAME
    is_project = registry.is_file() and (directory / KERNELS_NAME).is_dir()
    return registry if is_project and not (directory / "kernel_hub").is_dir() else None


def registry_path() -> Path:
    """``$KERNEL_HUB_REGISTRY``, else the current directory's if it is a kernel project, else the
    built-in registry.yaml."""
    if os.environ.get("KERNEL_HUB_REGISTRY"):
        return Path(os.environ["KERNEL_HUB_REGISTRY"])
    return project_registry(Path.cwd()) or BUILTIN_DIR / REGISTRY_NAME


def kernels_dir() -> Path:
    """``$KERNEL_HUB_KERNELS_DIR`` or the built-in kernels."""
    return Path(os.environ.get("KERNEL_HUB_KERNELS_DIR", BUILTIN_DIR / KERNELS_NAME))


def kernel_dir_for(registry: str | Path, kernel: str) -> Path:
    """The in-tree directory of ``kernel`` for a registry file: ``$KERNEL_HUB_KERNELS_DIR``'s when
    set, else the ``kernels/`` folder beside the registry when it holds the kernel, else the
    built-in one."""
    if registry and "KERNEL_HUB_KERNELS_DIR" not in os.environ:
        beside = Path(registry).parent / KERNELS_NAME / kernel
        if beside.is_dir():
            return beside
    return kernels_dir() / kernel
