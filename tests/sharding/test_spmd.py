"""Every kernel's JAX functions under SPMD on 8 simulated CPU devices (Explicit meshes (8,) and
(2,4)): sharded forward and gradients equal the single-device call, output shardings are the
rule's, and shardings a rule cannot serve are refused. The checks run in one subprocess
(``spmd_checks.py``), since the device count is fixed when JAX starts."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import kernel_hub

SCRIPT = Path(__file__).with_name("spmd_checks.py")


def _check_names(script: Path) -> list[str]:
    """The functions decorated ``@check`` in a checks script, in file order."""
    tree = ast.parse(script.read_text())
    return [
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef)
        and any(isinstance(d, ast.Name) and d.id == "check" for d in node.decorator_list)
    ]


def run_checks(script: Path) -> dict[str, dict]:
    """Run a checks script in a fresh interpreter; its results by check name."""
    root = Path(kernel_hub.__file__).resolve().parents[1]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, "-P", str(script)], capture_output=True, text=True, env=env, timeout=600
    )
    results = {}
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            result = json.loads(line)
            results[result["check"]] = result
    assert results, f"no results (exit {done.returncode}):\n{done.stderr[-3000:]}"
    return results


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    return run_checks(SCRIPT)


@pytest.mark.slow
@pytest.mark.parametrize("name", _check_names(SCRIPT))
def test_sharded_kernel(results: dict[str, dict], name: str) -> None:
    assert name in results, f"check {name} did not report"
    result = results[name]
    assert result["ok"], json.dumps(result, indent=1)
