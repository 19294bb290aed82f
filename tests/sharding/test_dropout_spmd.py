"""Attention dropout sharded over batch and heads on 8 simulated CPU devices equals the
unsharded call (the same mask), forward and gradients: ``dropout_spmd_checks.py`` in a fresh
process (the device count is fixed when JAX starts)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from .checks_runner import run_checks

SCRIPT = Path(__file__).with_name("dropout_spmd_checks.py")
NAMES = ("explicit_batch_heads", "auto_batch_heads", "backward_batch_heads")


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    return run_checks([sys.executable, "-P"], SCRIPT, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_sharded_dropout_draws_the_unsharded_mask(results: dict[str, dict], name: str) -> None:
    assert name in results, f"check {name} did not report"
    assert results[name]["ok"], json.dumps(results[name], indent=1)
