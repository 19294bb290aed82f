"""kernel-hub ops under torch.distributed, 2 ranks on gloo (``torchrun_checks.py``): a DTensor
input to rms_norm through its registered strategy (forward and backward), and a tiny Llama
(tensor-parallel plan) and tiny Mixtral (expert-parallel plan: AllToAllEP in training, the
default at inference), kernelized, against the unsharded stock models, and expert-split DTensor
weights without an expert-parallel dispatch left alone with the reason."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from .checks_runner import check_names, run_checks

SCRIPT = Path(__file__).with_name("torchrun_checks.py")


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    torchrun = [sys.executable, "-P", "-m", "torch.distributed.run", "--standalone"]
    return run_checks([*torchrun, "--nproc-per-node", "2"], SCRIPT)


@pytest.mark.slow
@pytest.mark.parametrize("name", check_names(SCRIPT))
def test_distributed(results: dict[str, dict], name: str) -> None:
    assert name in results, f"check {name} did not report"
    assert results[name]["ok"], json.dumps(results[name], indent=1)
