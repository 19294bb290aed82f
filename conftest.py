"""Shared test fixtures for the library tests and every kernel's own tests."""

from __future__ import annotations

import pytest
import torch

from kernel_hub.compile_check import allow_shared_libtpu

# Tests, their subprocesses and deviceless TPU compiles all load libtpu at once.
allow_shared_libtpu()


@pytest.fixture(autouse=True)
def _seeded() -> None:
    torch.manual_seed(0)


def max_errors(actual: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    """(max abs error, max relative error) in float64."""
    actual, expected = actual.double(), expected.double()
    diff = (actual - expected).abs()
    rel = diff / expected.abs().clamp_min(1e-6)
    return float(diff.max()) if diff.numel() else 0.0, float(rel.max()) if rel.numel() else 0.0
