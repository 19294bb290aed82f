"""Plain-text tables and JSON output shared by the commands.

Tables fit the terminal (``COLUMNS`` when set, else the terminal's width, else 100 columns when
the output is not a terminal): the widest columns are narrowed and their cells wrapped onto more
lines, never cut, so a table shows every value; ``--json`` gives them unwrapped.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Sequence
from typing import Any

GAP = "  "
MIN_COLUMN = 12
"""A column is never narrowed below this (or its widest cell, when that is shorter)."""


def terminal_width() -> int:
    return shutil.get_terminal_size((100, 24)).columns


def column_widths(natural: Sequence[int], width: int) -> list[int]:
    """``natural`` (each column's widest cell) narrowed, widest first, until the row fits
    ``width``; columns stop at ``MIN_COLUMN``, so a very narrow terminal still gets a table."""
    widths = list(natural)
    available = width - len(GAP) * (len(widths) - 1)
    floors = [min(w, MIN_COLUMN) for w in widths]
    while sum(widths) > available:
        widest = max(range(len(widths)), key=lambda i: widths[i] - floors[i])
        if widths[widest] <= floors[widest]:
            break
        widths[widest] -= 1
    return widths


_PIECE = re.compile(r"[^\s,;/]*[,;/]?\s*")
"""A word with the separator after it: lines break after spaces, commas, semicolons, slashes."""


def _lines(text: str, width: int) -> list[str]:
    """``text`` wrapped to ``width``: at separators where it can, inside a word where not."""
    if len(text) <= width:
        return [text]
    lines, line = [], ""
    for piece in _PIECE.findall(text):
        if line and len(line) + len(piece.rstrip()) > width:
            lines.append(line.rstrip())
            line = ""
        line += piece if line else piece.lstrip()
        while len(line.rstrip()) > width:
            lines.append(line[:width])
            line = line[width:]
    return [*lines, line.rstrip()] if line.strip() else lines


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [[str(c) for c in row] for row in rows]
    natural = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    widths = column_widths(natural, terminal_width())

    def emit(row: Sequence[str]) -> None:
        wrapped = [_lines(cell, w) for cell, w in zip(row, widths, strict=True)]
        for index in range(max(len(lines) for lines in wrapped)):
            parts = [
                (lines[index] if index < len(lines) else "").ljust(w)
                for lines, w in zip(wrapped, widths, strict=True)
            ]
            print(GAP.join(parts).rstrip())

    emit(headers)
    print(GAP.join("-" * w for w in widths))
    for row in cells:
        emit(row)


def print_wrapped(text: str, indent: str = "") -> None:
    """A paragraph of prose at the table's width; continuation lines indented two more spaces."""
    lines = _lines(text, max(terminal_width() - len(indent) - 2, MIN_COLUMN))
    print(indent + lines[0].lstrip() if lines else indent)
    for line in lines[1:]:
        print(f"{indent}  {line}")


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, sort_keys=True, default=str))
