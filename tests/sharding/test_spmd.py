"""Every kernel's JAX functions under SPMD on 8 simulated CPU devices (Explicit meshes (8,) and
(2,4)): sharded forward and gradients equal the single-device call, output shardings are the
rule's, shardings a rule cannot serve are refused; the EP MoE layer and ring attention match
their unsharded references; torchax tensors holding sharded arrays go through the same rule.
All checks run in one subprocess (``spmd_checks.py``): the device count is fixed when JAX starts.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from .checks_runner import check_names, run_checks

SCRIPT = Path(__file__).with_name("spmd_checks.py")


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    return run_checks([sys.executable, "-P"], SCRIPT, timeout=1800)  # ~10 min on 2 busy cores


@pytest.mark.slow
@pytest.mark.parametrize("name", check_names(SCRIPT))
def test_sharded(results: dict[str, dict], name: str) -> None:
    assert name in results, f"check {name} did not report"
    assert results[name]["ok"], json.dumps(results[name], indent=1)
