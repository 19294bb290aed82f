"""Run the commands of docs/model-bench.md's "Every preset at real size" table, one at a time,
and say what each cost (wall and CPU seconds, exit status) and what the whole table cost.

    PYTHONPATH=. python scripts/model_bench_table.py OUT_DIR [--only REGEX] [--dry-run]

The commands are read from the docs' block, so the table and this script cannot drift apart;
each writes its JSON to OUT_DIR (named after its arguments) instead of the block's ``out.json``.
model-bench keeps every compiled program's figures (``kernel_hub.bench.figure_cache``): the
first run compiles every program, a rerun with nothing changed compiles none and costs the
models' building, tracing and lowering. ``KERNEL_HUB_FIGURE_CACHE_DIR`` chooses the cache; set
it to an empty directory to time a first run. Every command runs whatever the others did; exit
status 2 is model-bench's refusal of its input (the rows where neither variant fits a chip), and
any other non-zero status makes this script's 1.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shlex
import subprocess
import sys
import time
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "model-bench.md"
SECTION = "### Every preset at real size"
_BLOCK = re.compile(r"```bash\n(.*?)```", re.S)
PROGRAM = "kernel-hub model-bench "


def table_commands(doc: str) -> list[list[str]]:
    """The model-bench arguments of each command in the section's first bash block, less
    ``--json PATH`` (the script names the JSON itself)."""
    section = doc.split(SECTION, 1)[1]
    block = _BLOCK.search(section)
    if block is None:
        raise ValueError(f"no bash block under {SECTION!r}")
    commands = []
    for line in block.group(1).splitlines():
        if not line.startswith(PROGRAM):
            continue
        args = shlex.split(line[len(PROGRAM) :])
        if "--json" in args:
            at = args.index("--json")
            del args[at : at + 2]
        commands.append(args)
    return commands


def json_name(args: list[str]) -> str:
    """A file name from the arguments: ``llama-3-8b--mode-train--seq-8192....json``."""
    return re.sub(r"[^\w.-]+", "-", "-".join(args)).strip("-") + ".json"


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run(args: list[str], out_dir: Path) -> tuple[int, float, float]:
    """One command in a fresh process: exit status, wall seconds, CPU seconds."""
    command = [sys.executable, "-m", "kernel_hub.cli", "model-bench", *args]
    command += ["--json", str(out_dir / json_name(args))]
    log = out_dir / json_name(args).replace(".json", ".log")
    cpu, start = _cpu_seconds(), time.perf_counter()
    with log.open("w") as output:
        status = subprocess.run(command, stdout=output, stderr=subprocess.STDOUT).returncode
    return status, time.perf_counter() - start, _cpu_seconds() - cpu


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--only", metavar="REGEX", help="the commands whose arguments match")
    parser.add_argument("--dry-run", action="store_true", help="list the commands, run none")
    options = parser.parse_args(argv)
    commands = table_commands(DOC.read_text())
    if options.only:
        commands = [a for a in commands if re.search(options.only, " ".join(a))]
    if options.dry_run:
        for args in commands:
            print(PROGRAM + shlex.join(args))
        return 0
    options.out_dir.mkdir(parents=True, exist_ok=True)
    print(f"figure cache: {os.environ.get('KERNEL_HUB_FIGURE_CACHE_DIR', 'the default')}")
    failed, total_wall, total_cpu = 0, 0.0, 0.0
    for args in commands:
        status, wall, cpu = run(args, options.out_dir)
        failed += status not in (0, 2)
        total_wall, total_cpu = total_wall + wall, total_cpu + cpu
        print(f"{wall:7.0f} s wall {cpu:7.0f} CPU-s  exit {status}  {shlex.join(args)}", flush=True)
    print(f"{len(commands)} commands: {total_wall:.0f} s wall, {total_cpu:.0f} CPU-s")
    print(f"{failed} failed (an exit status other than 0 or 2)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
