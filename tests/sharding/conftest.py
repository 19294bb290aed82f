"""The 2-rank torchrun shared by test_torchrun.py and test_serving.py."""

from __future__ import annotations

import pytest

from .checks_runner import run_torchrun


@pytest.fixture(scope="session")
def two_rank_results() -> dict[str, dict]:
    """The torch.distributed checks and the 2-rank continuous-batching checks, in one torchrun
    (rank_checks.py: each rank's imports and kernel loads made once for both)."""
    return run_torchrun(2, "torchrun_checks", "serving_checks")
