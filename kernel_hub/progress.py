"""A progress bar on stderr for long runs: tqdm when installed, else a one-line text bar."""

from __future__ import annotations

import sys
from typing import Any, Protocol


class Progress(Protocol):
    def set_description(self, text: str) -> None: ...
    def update(self, steps: int = 1) -> None: ...
    def close(self) -> None: ...


class _TextBar:
    """Minimal stand-in for tqdm: ``[#####.....] 5/10 description`` redrawn in place."""

    def __init__(self, total: int, stream: Any):
        self.total = max(total, 1)
        self.done = 0
        self.text = ""
        self.stream = stream

    def _draw(self) -> None:
        filled = 20 * self.done // self.total
        bar = "#" * filled + "." * (20 - filled)
        self.stream.write(f"\r[{bar}] {self.done}/{self.total} {self.text[:60]:<60}")
        self.stream.flush()

    def set_description(self, text: str) -> None:
        self.text = text
        self._draw()

    def update(self, steps: int = 1) -> None:
        self.done += steps
        self._draw()

    def close(self) -> None:
        self.stream.write("\n")
        self.stream.flush()


class _Silent:
    def set_description(self, text: str) -> None:
        pass

    def update(self, steps: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total: int, *, enabled: bool = True, unit: str = "cell") -> Progress:
    """A bar over ``total`` steps on stderr, or one that draws nothing when disabled."""
    if not enabled:
        return _Silent()
    try:
        from tqdm import tqdm
    except ImportError:
        return _TextBar(total, sys.stderr)
    return tqdm(total=total, unit=unit, file=sys.stderr, leave=False, dynamic_ncols=True)
