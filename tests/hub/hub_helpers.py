"""Constants and small helpers shared by the hub tests (fixtures live in conftest.py)."""

from __future__ import annotations

from pathlib import Path

from kernel_hub.paths import kernels_dir

RMSNORM = kernels_dir() / "rmsnorm"
REPO = "kernel-hub/rmsnorm"


def cache_dir(tmp_path: Path) -> Path:
    """The Hugging Face cache the ``hub_env`` fixture points at."""
    return tmp_path / "hf-cache"
