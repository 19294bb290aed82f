"""Fixtures for the ragged-attention tests: the kernel module, loaded the way get_kernel does."""

from __future__ import annotations

from pathlib import Path

import pytest

from kernel_hub.loader import load_kernel_dir

KERNEL_DIR = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def ragged():
    return load_kernel_dir(KERNEL_DIR)
