"""Continuous batching under 2- and 4-way tensor parallelism and expert parallelism (torchrun,
gloo, CPU): greedy tokens equal the unsharded model's ``generate()``, the serving kernels run on
each rank's heads, the MoE kernels on its experts; ``generate`` with the fp8 static KV cache
holds each rank's heads in fp8 and matches the unsharded model with that cache. 2 ranks share the
torchrun of the torch.distributed checks (conftest.py); 4 ranks run ``serving_checks.py`` alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .checks_runner import check_names, run_torchrun

SCRIPT = Path(__file__).with_name("serving_checks.py")


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [2, 4])
def test_sharded_continuous_batching(ranks: int, request: pytest.FixtureRequest) -> None:
    if ranks == 2:  # in the torchrun of the torch.distributed checks
        results = request.getfixturevalue("two_rank_results")
    else:
        results = run_torchrun(ranks, "serving_checks")
    for name in check_names(SCRIPT):
        assert name in results, f"check {name} did not report"
        assert results[name]["ok"], json.dumps(results[name], indent=1)
