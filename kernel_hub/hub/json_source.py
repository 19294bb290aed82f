"""Reading kernel-hub's JSON files (metadata, signatures, locks) so any input fails cleanly.

Every failure (missing file, bytes that are not UTF-8, bad JSON, nesting too deep for the parser)
becomes a ``SourceError`` with the file and, where known, the line.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from kernel_hub.errors import SourceError


def load_json(
    path: Path, text: str | None = None, *, missing: str = "file not found"
) -> tuple[str, Any]:
    """(text, parsed data) of ``path`` (or of ``text``, which then stands for its content)."""
    if text is None:
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise SourceError(path, None, missing) from None
        except OSError as exc:
            raise SourceError(path, None, f"cannot read: {exc.strerror or exc}") from None
        text = decode(path, data)
    try:
        return text, json.loads(text)
    except json.JSONDecodeError as exc:
        raise SourceError(path, exc.lineno, f"invalid JSON: {exc.msg}") from None
    except RecursionError:
        raise SourceError(path, None, "invalid JSON: nested too deeply") from None


def decode(path: Path, data: bytes) -> str:
    """``data`` (the content of ``path``) as UTF-8 text, or a ``SourceError`` at the bad line."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise SourceError(path, line, f"not UTF-8 text ({exc.reason})") from None


def field_line(text: str, key: str, after: str | None = None) -> int:
    """The line to point at for field ``key`` (JSON parsers keep no positions): where the first
    ``"key":`` is (after the first ``"after":`` if given), else where ``after`` is, else line 1
    (the document as a whole, e.g. for a missing field)."""
    start, line = 0, 1
    if after is not None:
        found = _key_pattern(after).search(text)
        if found:
            start, line = found.end(), text.count("\n", 0, found.start()) + 1
    match = _key_pattern(key).search(text, start)
    return text.count("\n", 0, match.start()) + 1 if match else line


def _key_pattern(key: str) -> re.Pattern:
    return re.compile(re.escape(json.dumps(key)) + r"\s*:")
