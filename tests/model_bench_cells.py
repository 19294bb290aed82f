"""Runs model-bench cells one after the other in this process; writes a JSON file of each
cell's exit status, output and rows.

test_model_bench.py and test_model_bench_presets.py run their cells here, one subprocess per
test module (``run_cells``) instead of one per cell:
each process pays its own imports of torch, JAX, torchax and Transformers and its own first
traces. A subprocess all the same: importing torchax renames torch's PrivateUse1 device for the
rest of a process.

Usage: ``python model_bench_cells.py CELLS.json OUT_DIR``, CELLS.json mapping a cell's name to
``{"argv": [...]}``, the command's arguments (without ``--json``), or ``{"code": ..., "argv":
[...]}``, a Python script's text and its arguments; writes ``OUT_DIR/results.json``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

import pytest

from kernel_hub.cli import main


def run_cell(cell: dict, rows_path: Path) -> dict:
    """One cell as the command (or ``python -c``) runs it; its rows: the command's ``--json``
    (None for a script). An exception is its traceback and status 1, so the cells after it
    still run."""
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            if "code" in cell:
                sys.argv = ["-c", *cell["argv"]]
                exec(compile(cell["code"], "<cell>", "exec"), {"__name__": "__main__"})
                status = 0
            else:
                status = main([*cell["argv"], f"--json={rows_path}"])
        except Exception:
            traceback.print_exc()
            status = 1
    rows = json.loads(rows_path.read_text()) if status == 0 and "code" not in cell else None
    return {
        "status": status,
        "stdout": stdout.getvalue(),
        "stderr": stderr.getvalue(),
        "rows": rows,
    }


def set_args(fields: dict) -> list[str]:
    """The command's ``--set`` arguments for a config's ``fields``."""
    return [f"--set={key}={json.dumps(value)}" for key, value in fields.items()]


def selected(request: pytest.FixtureRequest, item_cells) -> set[str]:
    """The cells the selected tests of the requesting module use (``item_cells(item)`` of each)."""
    items = [i for i in request.session.items if getattr(i, "module", None) is request.module]
    return set().union(*map(item_cells, items))


def run_cells(cells: dict[str, dict], out_dir: Path) -> dict[str, dict]:
    """``cells`` run by this script in one subprocess; each cell's status, output and rows."""
    (out_dir / "cells.json").write_text(json.dumps(cells))
    # model-bench's figure cache in the run's own directory: every cell compiles its programs
    # (no figures from an earlier run or the user's cache), and nothing is left in $HOME
    figures = {"KERNEL_HUB_FIGURE_CACHE_DIR": str(out_dir / "figures")}
    result = subprocess.run(
        [sys.executable, __file__, str(out_dir / "cells.json"), str(out_dir)],
        capture_output=True,
        text=True,
        timeout=1800,
        env={**os.environ, **figures},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads((out_dir / "results.json").read_text())


def ran(results: dict[str, dict], name: str) -> tuple[str, list[dict] | None]:
    """A cell's output (the command's table) and JSON rows; its error output when it failed."""
    cell = results[name]
    assert cell["status"] == 0, cell["stderr"][-4000:]
    return cell["stdout"], cell["rows"]


if __name__ == "__main__":
    cells, out_dir = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    results = {name: run_cell(cell, out_dir / f"{name}.json") for name, cell in cells.items()}
    (out_dir / "results.json").write_text(json.dumps(results))
