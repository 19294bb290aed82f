"""Shared by the staging and bridge-thread tests: record the staging buffers the bridge makes."""

from __future__ import annotations

import pytest

from kernel_hub.bridge.runtimes import dlpack, staging


def record_stagings(monkeypatch: pytest.MonkeyPatch) -> list[staging.InputStaging]:
    """Every InputStaging the DLPack runtime makes from now on (until monkeypatch undoes it)."""
    made: list[staging.InputStaging] = []

    class Recording(staging.InputStaging):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(dlpack, "InputStaging", Recording)
    return made
