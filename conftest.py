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

