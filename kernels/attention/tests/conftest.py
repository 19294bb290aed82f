"""Fixtures for the attention tests: the kernel module, loaded the way get_kernel loads it."""

from __future__ import annotations

from pathlib import Path

import pytest

from kernel_hub.loader import load_kernel_dir

KERNEL_DIR = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def attention():
    return load_kernel_dir(KERNEL_DIR)


@pytest.fixture
def pallas_first(attention):
    """Run the Pallas kernel (interpret mode) instead of the CPU default order."""
    table = attention.jax.TABLE
    saved = table.order("cpu")
    table.set_order("cpu", ("pallas", "xla"))
    yield
    table.set_order("cpu", saved)
