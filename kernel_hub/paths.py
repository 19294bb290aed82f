"""Where the built-in registry and kernels live, with environment overrides.

In the repository, ``registry.yaml`` and ``kernels/`` sit at the top level beside ``kernel_hub/``;
the wheel ships the same files as the data directory ``kernel_hub/builtin/`` (pyproject's
package-dir mapping). An installed package finds them beside its own modules, a checkout (an
editable install, or ``PYTHONPATH`` pointing at it) one directory up: never through the current
directory.
"""

from __future__ import annotations

import os
from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent


def _builtin_dir() -> Path:
    shipped = _PACKAGE_DIR / "builtin"
    return shipped if (shipped / "registry.yaml").is_file() else _PACKAGE_DIR.parent


BUILTIN_DIR = _builtin_dir()


def registry_path() -> Path:
    """``$KERNEL_HUB_REGISTRY`` or the built-in registry.yaml."""
    return Path(os.environ.get("KERNEL_HUB_REGISTRY", BUILTIN_DIR / "registry.yaml"))


def kernels_dir() -> Path:
    """``$KERNEL_HUB_KERNELS_DIR`` or the built-in kernels."""
    return Path(os.environ.get("KERNEL_HUB_KERNELS_DIR", BUILTIN_DIR / "kernels"))
