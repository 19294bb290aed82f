"""Constants and small helpers shared by the hub tests (fixtures live in conftest.py)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import yaml

from kernel_hub.paths import BUILTIN_DIR, kernels_dir

RMSNORM = kernels_dir() / "rmsnorm"
REPO = "kernel-hub/rmsnorm"
GAVE_UP_WAITS = [1.0, 2.0, 4.0, 8.0]
"""The waits between five failed tries of one request: a 1 s backoff doubling up to 8 s."""


def cache_dir(tmp_path: Path) -> Path:
    """The Hugging Face cache the ``hub_env`` fixture points at."""
    return tmp_path / "hf-cache"


def publishers_yaml(keys: Sequence[str], revoked: Sequence[str] = (), org: str = "kernel-hub"):
    """A registry ``publishers:`` section pinning ``keys`` for ``org``."""
    return yaml.safe_dump(
        {"publishers": {org: {"keys": list(keys), "revoked": list(revoked)}}}, sort_keys=False
    )


def signed_registry(
    directory: Path,
    ops: Sequence[str],
    keys: Sequence[str],
    revoked: Sequence[str] = (),
    org: str = "kernel-hub",
) -> Path:
    """The in-tree registry cut down to ``ops``, with ``keys`` pinned for ``org`` (only)."""
    data = yaml.safe_load((BUILTIN_DIR / "registry.yaml").read_text())
    data["ops"] = {name: data["ops"][name] for name in ops}
    data["publishers"] = {org: {"keys": list(keys), "revoked": list(revoked)}}
    path = Path(directory) / "registry.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path
