"""Run a checks script (one JSON line per check) in a fresh process and read its results.

The multi-device and multi-process checks need their own interpreters: the CPU device count is
fixed when JAX starts, torchax changes torch globally, torchrun starts the ranks.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import kernel_hub


def check_names(script: Path) -> list[str]:
    """The functions decorated ``@check`` in a checks script, in file order."""
    tree = ast.parse(script.read_text())
    return [
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef)
        and any(isinstance(d, ast.Name) and d.id == "check" for d in node.decorator_list)
    ]


def run_checks(
    command: Sequence[str], script: Path, *args: str, timeout: int = 900
) -> dict[str, dict]:
    """Results by check name of ``command + [script, *args]`` (with this checkout on the path)."""
    root = Path(kernel_hub.__file__).resolve().parents[1]
    path = [str(root), str(script.parent), os.environ.get("PYTHONPATH", "")]
    # LLVM at -O0: the checks compile many small programs and run each once, so LLVM's
    # optimization passes were much of their CPU time (SPMD checks: auto_gated_delta_rule +
    # auto_mamba2_scan + dense_mask_fwd_bwd 100 -> 50 CPU-s; continuous batching on 2 ranks
    # 55 -> 47). The SPMD checks compile both sides of each comparison alike; the torchrun
    # checks compare with stock torch at their own tolerances, unchanged (same greedy tokens).
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(path),
        "OMP_NUM_THREADS": "1",
        "XLA_FLAGS": flags,
    }
    done = subprocess.run(
        [*command, str(script), *args], capture_output=True, text=True, env=env, timeout=timeout
    )
    results = {}
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            result = json.loads(line)
            results[result["check"]] = result
    assert results, f"no results (exit {done.returncode}):\n{done.stderr[-3000:]}"
    return results


def run_torchrun(ranks: int, *modules: str) -> dict[str, dict]:
    """Results of the checks scripts ``modules`` in one torchrun of ``ranks`` ranks."""
    torchrun = [sys.executable, "-P", "-m", "torch.distributed.run", "--standalone"]
    command = [*torchrun, "--nproc-per-node", str(ranks)]
    return run_checks(command, Path(__file__).with_name("rank_checks.py"), *modules)
