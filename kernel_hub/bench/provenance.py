"""Where a recorded result came from: command, time, machine and library versions.

Every JSON file kernel-hub writes (benchmarks, compile matrices) carries this header, so a
number in ``benchmarks/`` can be traced to the command and environment that produced it.
"""

from __future__ import annotations

import datetime
import os
import platform as std_platform
import shlex
import subprocess
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

LIBRARIES = ("jax", "jaxlib", "libtpu", "torch", "numpy", "tokamax", "kernel-hub")


def library_versions(names: Sequence[str] = LIBRARIES) -> dict[str, str | None]:
    """Installed version of each distribution (None if not installed), plus Python's."""
    versions: dict[str, str | None] = {"python": std_platform.python_version()}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return std_platform.processor() or std_platform.machine()


def machine() -> dict[str, Any]:
    """The JAX device this process computes on and the host around it (with the load average:
    other processes on a shared host slow CPU timings down)."""
    from kernel_hub.platform import describe_host

    return {
        **describe_host(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


def source_revision() -> dict[str, Any] | None:
    """Git commit of the kernel-hub checkout this code runs from and whether its code (outside
    benchmarks/) had uncommitted changes; None for an installed wheel (no checkout of its own)."""
    package_dir = Path(__file__).resolve().parents[1]

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(package_dir), *args],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()

    try:
        top = Path(git("rev-parse", "--show-toplevel")).resolve()
        if top / "kernel_hub" != package_dir:  # e.g. a wheel inside a venv inside some repo
            return None
        commit = git("rev-parse", "HEAD")
        # recorded results being rewritten do not make the code that produced them dirty
        dirty = bool(git("status", "--porcelain", "--untracked-files=no", ":(exclude)benchmarks"))
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "dirty": dirty}


def command_line(prog: str, argv: Sequence[str]) -> str:
    """The command as a user would retype it."""
    return shlex.join([prog, *argv])


def header(command: str) -> dict[str, Any]:
    """Fields every recorded JSON file starts with."""
    return {
        "command": command,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "versions": library_versions(),
        "source": source_revision(),
    }
