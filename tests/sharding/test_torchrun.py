"""kernel-hub ops under torch.distributed, 2 ranks on gloo (``torchrun_checks.py``, in
the torchrun of the 2-rank continuous-batching checks: conftest.py): a DTensor
input to rms_norm through its registered strategy (forward and backward), and a tiny Llama
(tensor-parallel plan) and tiny Mixtral (expert-parallel plan: AllToAllEP in training, the
default at inference), kernelized, against the unsharded stock models, and expert-split DTensor
weights without an expert-parallel dispatch left alone with the reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .checks_runner import check_names

SCRIPT = Path(__file__).with_name("torchrun_checks.py")


@pytest.mark.slow
@pytest.mark.parametrize("name", check_names(SCRIPT))
def test_distributed(two_rank_results: dict[str, dict], name: str) -> None:
    results = two_rank_results
    assert name in results, f"check {name} did not report"
    assert results[name]["ok"], json.dumps(results[name], indent=1)
