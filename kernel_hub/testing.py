"""Helpers for kernel and library tests: error measures and cut-down registries."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from .paths import registry_path


def max_errors(actual: Any, expected: Any) -> tuple[float, float]:
    """(max abs error, max relative error) between two torch tensors, in float64."""
    actual, expected = actual.double(), expected.double()
    diff = (actual - expected).abs()
    rel = diff / expected.abs().clamp_min(1e-6)
    return float(diff.max()) if diff.numel() else 0.0, float(rel.max()) if rel.numel() else 0.0


def registry_with_ops(directory: Path, *ops: str) -> Path:
    """The registry cut down to ``ops``, written to ``directory/registry.yaml``.

    For tests of a mechanism (hub fetches, kernelize reports) that count what one kernel does.
    """
    registry = yaml.safe_load(registry_path().read_text())
    registry["ops"] = {name: registry["ops"][name] for name in ops}
    path = Path(directory) / "registry.yaml"
    path.write_text(yaml.safe_dump(registry))
    return path
