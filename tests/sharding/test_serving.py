"""Continuous batching under 2- and 4-way tensor parallelism (torchrun, gloo, CPU): greedy tokens
equal the unsharded model's ``generate()``, the serving kernels run on each rank's heads. Each
world size runs ``serving_checks.py`` in its own torchrun."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from .checks_runner import run_checks

SCRIPT = Path(__file__).with_name("serving_checks.py")


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [2, 4])
def test_tensor_parallel_continuous_batching(ranks: int) -> None:
    torchrun = [sys.executable, "-P", "-m", "torch.distributed.run", "--standalone"]
    results = run_checks([*torchrun, "--nproc-per-node", str(ranks)], SCRIPT)
    result = results["tensor_parallel_continuous_batching"]
    assert result["ok"], json.dumps(result, indent=1)
