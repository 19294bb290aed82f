"""Deviceless TPU devices: libtpu topologies that compile for a TPU generation without a chip.

A leaf shared by the compile check (bench) and the TPU runtimes' tracing target (bridge).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import re
import tempfile
from collections.abc import Iterator
from typing import Any

from .errors import RequirementError, UnknownNameError

# Generation -> smallest topology name libtpu accepts for it.
TOPOLOGIES: dict[str, str] = {
    "v4": "v4:2x2x1",
    "v5e": "v5e:2x2",
    "v5p": "v5p:2x2x1",
    "v6e": "v6e:2x2",
}
DEFAULT_GENERATIONS: tuple[str, ...] = tuple(TOPOLOGIES)

# libtpu's start-up chatter on a host without a TPU; everything else on stderr is kept.
_LIBTPU_NOISE = re.compile(
    r"TPU_ACCELERATOR_TYPE|TPU_WORKER_HOSTNAMES|host bounds|Logging before InitGoogle|"
    r"Source Location Trace|libtpu_init_utils|^\s*$|^E0000 .*common_lib\.cc"
)


@contextlib.contextmanager
def filtered_libtpu_stderr() -> Iterator[None]:
    """Swallow libtpu's known start-up warnings (written by C++ to fd 2), re-emit the rest."""
    with tempfile.TemporaryFile(mode="w+b") as sink:
        saved = os.dup(2)
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            kept = [
                line
                for line in sink.read().decode(errors="replace").splitlines()
                if not _LIBTPU_NOISE.search(line)
            ]
            if kept:
                os.write(2, ("\n".join(kept) + "\n").encode())


def allow_shared_libtpu() -> None:
    """Let this process load libtpu while another one holds it.

    libtpu takes a host-wide lock file when it loads; deviceless compiles touch no chip, so several
    processes (a test run and its subprocesses, a compile check beside a notebook) may share it.
    Must run before JAX first initialises its backends to take effect.
    """
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def tpu_device(generation: str) -> Any:
    """First device of a deviceless topology for ``generation`` (v4, v5e, v5p, v6e)."""
    return tpu_devices(generation)[0]


@functools.cache
def tpu_devices(generation: str, shape: str | None = None) -> tuple[Any, ...]:
    """Every device of the deviceless topology for ``generation`` (4 chips; v4: 8 cores), or of
    ``generation:shape`` (``shape`` such as ``4x4``) when given."""
    if generation not in TOPOLOGIES:
        raise UnknownNameError("TPU generation", generation, TOPOLOGIES)
    if importlib.util.find_spec("libtpu") is None:
        raise RequirementError(
            "deviceless TPU compiles need libtpu, which is not installed: "
            "pip install 'kernel-hub[tpu]'"
        )
    allow_shared_libtpu()
    from jax.experimental import topologies

    with filtered_libtpu_stderr():
        name = TOPOLOGIES[generation] if shape is None else f"{generation}:{shape}"
        return tuple(topologies.get_topology_desc(name, "tpu").devices)
