"""Where the in-tree registry and kernels live, with environment overrides."""

from __future__ import annotations

import os
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent


def registry_path() -> Path:
    """``$KERNEL_HUB_REGISTRY`` or the registry.yaml shipped beside the package."""
    return Path(os.environ.get("KERNEL_HUB_REGISTRY", PROJECT_ROOT / "registry.yaml"))


def kernels_dir() -> Path:
    """``$KERNEL_HUB_KERNELS_DIR`` or the in-tree ``kernels/`` directory."""
    return Path(os.environ.get("KERNEL_HUB_KERNELS_DIR", PROJECT_ROOT / "kernels"))
