"""Fixtures for the moe-gemm kernel tests: the kernel loaded the way users get it."""

from __future__ import annotations

from pathlib import Path

import pytest

from kernel_hub.loader import load_kernel_dir

KERNEL_DIR = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def moe():
    """The moe-gemm kernel module (torch ops, ``.jax``, ``.routing``, ``.integrations``...)."""
    return load_kernel_dir(KERNEL_DIR)
