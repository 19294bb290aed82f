"""Where the built-in registry and kernels live, with environment overrides.

Both ship inside the package (``kernel_hub/builtin/``), so a wheel, an sdist build and an editable
checkout find them the same way: beside this file, never through a checkout's root.
"""

from __future__ import annotations

import os
from pathlib import Path

BUILTIN_DIR = Path(__file__).resolve().parent / "builtin"


def registry_path() -> Path:
    """``$KERNEL_HUB_REGISTRY`` or the registry.yaml shipped in the package."""
    return Path(os.environ.get("KERNEL_HUB_REGISTRY", BUILTIN_DIR / "registry.yaml"))


def kernels_dir() -> Path:
    """``$KERNEL_HUB_KERNELS_DIR`` or the kernels shipped in the package."""
    return Path(os.environ.get("KERNEL_HUB_KERNELS_DIR", BUILTIN_DIR / "kernels"))
