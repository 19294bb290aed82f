"""Compile sharded kernels for multi-chip TPU topologies without a TPU, and check the collectives.

Each ``MeshCase`` (from a kernel's declared ``mesh_cases()``) is compiled under plain ``jit`` with
inputs sharded over every device of a deviceless topology (v5e:2x2, v5p:2x2x1, v6e:2x2: 4 chips;
v4:2x2x1: 8), forward and backward, on an Explicit-axis mesh and on an Auto-axis one (the
long-standing ``Mesh(devices, names)``, where the kernel's boundary places inputs by the mesh-axis
conventions and the partitioner reshards the rest). A cell passes when the program compiles,
holds Mosaic kernels (so the TPU kernel ran, not the interpreter; a backward the case says is
XLA's holds none) and at least the collectives the case names (all-reduce for replicated
weights' gradients, ragged-all-to-all for expert parallelism, collective-permute for the ring;
on Auto meshes also the reshards of inputs placed against the conventions). The negative control
compiles the same function on an Auto-axis mesh with the boundary bypassed: Mosaic must refuse it
("cannot be automatically partitioned"), which shows the boundary is what makes the other cells
compile.
"""

from __future__ import annotations

import functools
import re
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kernel_hub.sharding.cases import MeshCase, default_mesh_shape
from kernel_hub.topologies import filtered_libtpu_stderr, tpu_devices

from .compile_check import check_generations, no_persistent_cache
from .overflow import memory_overflow

COLLECTIVES = (
    "all-reduce",
    "all-gather",
    "all-to-all",
    "ragged-all-to-all",
    "collective-permute",
    "reduce-scatter",
)
_OP = re.compile(r"(?<![\w-])(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")
_MOSAIC = re.compile(r'custom_call_target="tpu_custom_call"')
CONTROL = "control"
"""The direction name of the negative-control cell."""
MESH_KINDS = ("explicit", "auto")


def count_collectives(hlo: str) -> dict[str, int]:
    """Collective ops (async starts counted once) and Mosaic kernels in compiled HLO text."""
    counts = Counter(match.group(1) for match in _OP.finditer(hlo))
    counts["mosaic"] = len(_MOSAIC.findall(hlo))
    return dict(counts)


@dataclass
class MeshCompileResult:
    """One cell: a case, a direction (forward, backward or control) and a generation."""

    kernel: str
    case: str
    direction: str
    generation: str
    mesh: str
    kind: str
    ok: bool
    seconds: float
    collectives: dict[str, int] = field(default_factory=dict)
    error: str | None = None
    overflow: dict[str, Any] | None = None
    """{space: 'HBM' | 'VMEM', asked, available} (bytes) when the program did not fit."""

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "status": "pass" if self.ok else "fail"}


def tpu_mesh(generation: str, axes: tuple[str, ...], explicit: bool = True) -> Any:
    """A mesh over every device of ``generation``'s deviceless topology."""
    import numpy as np
    from jax.sharding import AxisType, Mesh

    devices = tpu_devices(generation)
    shape = default_mesh_shape(axes, len(devices))
    kind = AxisType.Explicit if explicit else AxisType.Auto
    return Mesh(np.array(devices).reshape(shape), axes, axis_types=(kind,) * len(axes))


def _staged(case: MeshCase, direction: str, mesh: Any):
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    args = [
        jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, PartitionSpec(*s)))
        for a, s in zip(case.args, case.specs, strict=True)
    ]
    if direction != "backward":
        return case.fn, args

    def forward_and_backward(*arrays):
        def on_diff(*diff):
            full = list(arrays)
            for index, value in zip(case.differentiable, diff, strict=True):
                full[index] = value
            return case.fn(*full)

        out, pullback = jax.vjp(on_diff, *(arrays[i] for i in case.differentiable))
        return pullback(jax.tree.map(jax.numpy.ones_like, out))

    return forward_and_backward, args


def cell_problems(case: MeshCase, direction: str, kind: str, counts: dict[str, int]) -> list[str]:
    """Why a compiled cell (not the control) fails, from its program's ``count_collectives``:
    a collective the case expects is missing, or no Mosaic kernel ran; [] when it passes."""
    backward = direction == "backward"
    wanted = case.backward_collectives if backward else case.forward_collectives
    if kind == "auto":
        auto = case.auto_backward_collectives if backward else case.auto_forward_collectives
        wanted = wanted if auto is None else auto
    problems = [
        f"{name}: {counts.get(name, 0)} in the program, expected at least {least}"
        for name, least in wanted.items()
        if counts.get(name, 0) < least
    ]
    if not counts.get("mosaic") and not (backward and case.xla_backward):
        problems.append("no Mosaic kernel in the program (traced off the TPU device?)")
    return problems


def _compiled_text(case: MeshCase, direction: str, mesh: Any) -> str:
    import jax

    fn, args = _staged(case, direction, mesh)
    # A fresh function each cell: jit's trace cache ignores the bypass.
    return jax.jit(lambda *a: fn(*a)).trace(*args).lower().compile().as_text()


def compiled_hlo(case: MeshCase, generation: str, direction: str, kind: str = "auto") -> str:
    """The compiled program of one cell (no control), for checks beyond collective counts."""
    import jax

    mesh = tpu_mesh(generation, case.axes, explicit=kind == "explicit")
    with filtered_libtpu_stderr(), no_persistent_cache(), jax.default_device(mesh.devices.flat[0]):
        return _compiled_text(case, direction, mesh)


def collective_shapes(hlo: str) -> list[tuple[str, str]]:
    """(collective, result shape text) of every collective in compiled HLO text."""
    pattern = re.compile(r"= (\(?[^=]*?\)?) (" + "|".join(COLLECTIVES) + r")(?:-start)?\(")
    return [(m.group(2), m.group(1)) for m in pattern.finditer(hlo)]


def compile_mesh_case(
    kernel: str, case: MeshCase, generation: str, direction: str, kind: str = "explicit"
):
    """Compile one cell; failures are results. The control (always an Auto mesh, the boundary
    bypassed) passes when the compile fails."""
    import contextlib

    import jax

    from kernel_hub.sharding.boundary import bypassed

    control = direction == CONTROL
    kind = "auto" if control else kind
    if kind not in MESH_KINDS:
        raise ValueError(f"mesh kind {kind!r}; valid: {MESH_KINDS}")
    mesh = tpu_mesh(generation, case.axes, explicit=kind == "explicit")
    shape = "x".join(str(s) for s in mesh.devices.shape)
    cell = functools.partial(
        MeshCompileResult, kernel, case.name, direction, generation, f"{shape} {case.axes}", kind
    )
    start = time.perf_counter()
    try:
        with (
            filtered_libtpu_stderr(),
            no_persistent_cache(),
            jax.default_device(mesh.devices.flat[0]),
            bypassed() if control else contextlib.nullcontext(),
        ):
            hlo = _compiled_text(case, direction, mesh)
    except Exception as exc:  # the compiler's message is the result
        message = f"{type(exc).__name__}: {exc}".strip()[:1500]
        refused = "cannot be automatically partitioned" in message
        overflow = memory_overflow(message)
        return cell(
            ok=control and refused,
            seconds=time.perf_counter() - start,
            error=message,
            overflow=None if overflow is None else asdict(overflow),
        )
    seconds = time.perf_counter() - start
    counts = count_collectives(hlo)
    if control:
        return cell(
            ok=False,
            seconds=seconds,
            collectives=counts,
            error="the control compiled: the boundary is not what makes it work",
        )
    problems = cell_problems(case, direction, kind, counts)
    return cell(
        ok=not problems, seconds=seconds, collectives=counts, error="; ".join(problems) or None
    )


def kernel_mesh_cases(op: str, registry: str | None = None) -> tuple[str, list[MeshCase]]:
    """(kernel name, its mesh cases) for a registry op; a kernel without any gives []."""
    from kernel_hub.loading.resolver import get_kernel

    kernel = get_kernel(op, registry=registry)
    cases = kernel.KERNEL.mesh_cases
    return kernel.manifest.name, list(cases() if cases is not None else [])


def mesh_matrix(
    ops: Sequence[str],
    generations: Sequence[str],
    *,
    directions: Sequence[str] = ("forward", "backward"),
    kinds: Sequence[str] = MESH_KINDS,
    control: bool = True,
    registry: str | None = None,
) -> list[MeshCompileResult]:
    """Every mesh case of the ops x direction x mesh kind x generation, plus one negative control
    per case on the first generation."""
    generations = check_generations(generations)
    results = []
    for op in ops:
        kernel, cases = kernel_mesh_cases(op, registry)
        for case in cases:
            for direction in directions:
                if direction == "backward" and not case.differentiable:
                    continue
                results += [
                    compile_mesh_case(kernel, case, g, direction, kind)
                    for kind in kinds
                    for g in generations
                ]
            if control and case.control:
                results.append(compile_mesh_case(kernel, case, generations[0], CONTROL))
    return results
