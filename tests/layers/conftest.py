"""Fixtures for the kernelize tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from .kernelize_helpers import TmpHub


@pytest.fixture
def tmp_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> TmpHub:
    hub = TmpHub(tmp_path)
    monkeypatch.setenv("KERNEL_HUB_KERNELS_DIR", str(hub.kernels))
    return hub
