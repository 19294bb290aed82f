"""Sharded compile cases: a kernel function, sharded abstract inputs and the collectives its
compiled program must contain (what ``kernel-hub compile-check --mesh`` asserts)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


def default_mesh_shape(axes: tuple[str, ...], devices: int) -> tuple[int, ...]:
    """One axis: every device on it; two: (2, devices // 2)."""
    if len(axes) == 1:
        return (devices,)
    if len(axes) == 2:
        return (2, devices // 2)
    raise ValueError(f"a mesh case has one or two axes, got {axes}")


@dataclass(frozen=True)
class MeshCase:
    """One sharded program to compile for a multi-chip topology."""

    name: str
    fn: Callable[..., Any]
    """Takes the arrays in ``args`` positionally."""
    args: tuple[Any, ...]
    """``jax.ShapeDtypeStruct``s (global shapes; divisible by 8-device meshes)."""
    specs: tuple[tuple[str | None, ...], ...]
    """The ``PartitionSpec`` entries of each argument."""
    axes: tuple[str, ...]
    differentiable: tuple[int, ...] = ()
    forward_collectives: Mapping[str, int] = field(default_factory=dict)
    """HLO collective -> the least number of them the compiled forward holds."""
    backward_collectives: Mapping[str, int] = field(default_factory=dict)
    auto_forward_collectives: Mapping[str, int] | None = None
    """On an Auto mesh, where the boundary places inputs by the mesh-axis conventions
    (``sharding.context``) and the partitioner reshards inputs whose ``specs`` differ (all-gather,
    all-to-all); None: the same as on an Explicit mesh."""
    auto_backward_collectives: Mapping[str, int] | None = None
    xla_backward: bool = False
    """The backward is XLA's (a ``custom_vjp`` whose Pallas forward saves only its inputs, so the
    gradient program holds no Mosaic kernel): the backward cell does not ask for one."""
    control: bool = True
    """Compile a negative control (Auto mesh, the boundary bypassed: Mosaic must refuse). False
    for layers that are their own shard_map (they refuse a mesh-less call themselves)."""
