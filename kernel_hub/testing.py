"""Helpers for kernel and library tests, and the pytest plugin they run under.

The plugin (``-p kernel_hub.testing``, set in pyproject.toml) replaces a root ``conftest.py``: a
conftest at the checkout's root would put the checkout on ``sys.path`` and shadow the installed
wheel the tests are meant to exercise. With ``KERNEL_HUB_TEST_INSTALLED=1`` (set by
``scripts/test.sh``) the session refuses to start on a ``kernel_hub`` imported from the checkout.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from .paths import registry_path
from .topologies import allow_shared_libtpu

# Tests, their subprocesses and deviceless TPU compiles all load libtpu at once.
allow_shared_libtpu()


def max_errors(actual: Any, expected: Any) -> tuple[float, float]:
    """(max abs error, max relative error) between two torch tensors, in float64."""
    actual, expected = actual.double(), expected.double()
    diff = (actual - expected).abs()
    rel = diff / expected.abs().clamp_min(1e-6)
    return float(diff.max()) if diff.numel() else 0.0, float(rel.max()) if rel.numel() else 0.0


def greedy_continuations(
    model: torch.nn.Module, prompts: list[list[int]], generation_config: Any
) -> list[list[int]]:
    """Each prompt's continuation by the model's own ``generate()``, one prompt a call: the
    unbatched reference that batched and sharded serving is compared against (no padding)."""
    tokens = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), generation_config=generation_config
            )
            tokens.append(out[0, len(prompt) :].tolist())
    return tokens


def count_slot_calls(model: torch.nn.Module, names: Any) -> dict[str, int]:
    """Wrap the function slots ``names`` that kernelize filled on ``model``'s modules with call
    counters; the returned dict counts each slot's calls from then on."""
    calls = dict.fromkeys(names, 0)

    def counted(name: str, fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return fn(*args, **kwargs)

        return call

    for module in model.modules():
        for name in calls:
            if name in module.__dict__:
                module.__dict__[name] = counted(name, module.__dict__[name])
    return calls


def pallas_call_outputs(fn: Any, *args: Any) -> list[tuple[str, tuple[tuple[int, ...], ...]]]:
    """(name, output shapes) of every Pallas call in ``fn``'s traced program, in order, nested
    programs (jit, custom_vjp primals, loops) included: which buffers the kernels write."""
    import jax

    found = []

    def walk(jaxpr: Any) -> None:
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                found.append((eqn.params["name"], tuple(v.aval.shape for v in eqn.outvars)))
            for value in eqn.params.values():
                for item in value if isinstance(value, (tuple, list)) else (value,):
                    inner = getattr(item, "jaxpr", item)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


def kernel_ops(kernel_module: Any) -> dict[str, Any]:
    """Every torch op (``JaxOp``) defined in a loaded kernel package's modules, by op name."""
    from .bridge.torch_op import JaxOp  # not at plugin load: it imports JAX

    prefix = kernel_module.__name__ + "."
    found = {}
    for name, module in list(sys.modules.items()):
        if module is None or not (name == kernel_module.__name__ or name.startswith(prefix)):
            continue
        for value in vars(module).values():
            if isinstance(value, JaxOp):
                found[value.qualname.split("::")[1]] = value
    return found


def registry_with_ops(directory: Path, *ops: str) -> Path:
    """The registry cut down to ``ops``, written to ``directory/registry.yaml``.

    For tests of a mechanism (hub fetches, kernelize reports) that count what one kernel does.
    """
    registry = yaml.safe_load(registry_path().read_text())
    registry["ops"] = {name: registry["ops"][name] for name in ops}
    path = Path(directory) / "registry.yaml"
    path.write_text(yaml.safe_dump(registry))
    return path


def pytest_report_header(config: pytest.Config) -> str:
    return f"kernel_hub: {Path(__file__).resolve().parent}"


def _count_lines(path: str) -> int | None:
    try:
        with open(path) as lines:
            return sum(1 for _ in lines)
    except OSError:
        return None


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Report the process's memory mappings against the kernel's limit (Linux only).

    Each XLA CPU executable holds a few mappings of JIT code, and the bridge keeps its
    executables for the life of the process (bounded per op by row buckets in a user's process).
    A test session compiles thousands: one that reaches ``vm.max_map_count`` dies in LLVM with a
    segmentation fault, not an error, so the count is shown where its growth can be seen."""
    mappings = _count_lines("/proc/self/maps")
    if mappings is None:
        return
    try:
        limit = Path("/proc/sys/vm/max_map_count").read_text().strip()
    except OSError:
        limit = "unknown"
    terminalreporter.write_line(
        f"kernel-hub: this process holds {mappings} memory mappings (vm.max_map_count: {limit})"
    )


def pytest_configure(config: pytest.Config) -> None:
    """Apply the bridge's thread policy before collection imports any test module.

    The policy (JAX's CPU dispatch mode, and with it the bridge's input staging) only applies if
    kernel-hub's first call comes before JAX's backends start, and then holds for the process. A
    test module that makes a JAX array at import (``jnp.int32(1234)`` in a module constant)
    starts them during collection, so whether the whole session ran as a user's process does
    (kernel-hub starting JAX: inline dispatch, staging on) depended on which modules were
    collected: the full suite ran with JAX's async dispatch and no staging at all. Applied here,
    every session runs in that state, whatever the selection. Checks of how a process starts
    (the policy at the first call, ``KERNEL_HUB_THREADS=default``) use fresh interpreters
    (tests/test_bridge.py's ``run_child``)."""
    from .bridge.threads import apply_default_policy

    apply_default_policy()


def pytest_sessionstart(session: pytest.Session) -> None:
    package = Path(__file__).resolve().parent
    checkout = Path(session.config.rootpath).resolve() / "kernel_hub"
    if os.environ.get("KERNEL_HUB_TEST_INSTALLED") == "1" and package == checkout:
        raise pytest.UsageError(
            f"KERNEL_HUB_TEST_INSTALLED=1 but kernel_hub was imported from the checkout "
            f"({package}), not from the installed wheel"
        )


@pytest.fixture(autouse=True)
def _seeded() -> None:
    torch.manual_seed(0)
