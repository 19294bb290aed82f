"""Fixtures for the ragged-attention tests: the installed kernel, loaded as get_kernel loads it."""

from __future__ import annotations

import pytest

from kernel_hub.loading.loader import load_kernel_dir
from kernel_hub.paths import kernels_dir


@pytest.fixture(scope="session")
def ragged():
    return load_kernel_dir(kernels_dir() / "ragged-attention")
