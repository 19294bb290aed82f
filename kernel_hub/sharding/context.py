"""``use_mesh``: the mesh and factor -> mesh axes rules for calls made on an Auto-axis mesh.

On an Explicit-axis mesh every array carries its sharding (``jax.typeof(x).sharding``), even inside
``jit``, so kernel-hub reads it there. On an Auto-axis mesh a traced array reports its mesh but no
partition spec (the partitioner decides it after tracing), so kernel-hub falls back on
``CONVENTIONAL_AXES``: the mesh-axis names MaxText-style code gives data and tensor parallelism
(``data``/``fsdp`` split ``batch`` and the first leading dimension, ``model``/``tp`` split
``heads``, a depthwise conv's ``channels``, a gated MLP's ``intermediate`` features (Megatron's
column-split gate and up) and an LM head's ``vocab``, ``ep`` splits ``experts``).
An input sharded otherwise is resharded to that placement by the partitioner (the collective
shows in the compiled program). ``use_mesh`` states the rules for a region instead: which mesh,
and which mesh axes split which rule factor (``batch``, ``heads``, ``...`` for the leading
dimensions of row-wise ops, ...).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

from .rule import ELLIPSIS, ShardingError
from .solve import Axes

AxisRule = str | tuple[str, ...] | None


@dataclass(frozen=True)
class MeshContext:
    """The mesh of a ``use_mesh`` region and its factor -> mesh axes rules."""

    mesh: Any
    rules: Mapping[str, tuple[Axes, ...]]
    conventional: bool = False
    """Rules guessed from the mesh-axis names (an Auto mesh outside ``use_mesh``): a factor
    these cannot divide stays unsplit instead of being an error."""

    def axes_of(self, factor: str) -> Axes:
        """Mesh axes splitting ``factor`` (``...0``, ``...1`` are the leading dimensions)."""
        if factor.startswith(ELLIPSIS):
            per_dim = self.rules.get(ELLIPSIS, ())
            index = int(factor[len(ELLIPSIS) :])
            return per_dim[index] if index < len(per_dim) else ()
        return self.rules.get(factor, ((),))[0]


_CURRENT: contextvars.ContextVar[MeshContext | None] = contextvars.ContextVar(
    "kernel_hub_mesh", default=None
)


def _as_axes(value: AxisRule) -> Axes:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


def _normalised(mesh: Any, rules: Mapping[str, Any]) -> dict[str, tuple[Axes, ...]]:
    out = {}
    for factor, value in rules.items():
        per_dim = value if factor == ELLIPSIS else (value,)
        if factor == ELLIPSIS and isinstance(value, str):
            per_dim = (value,)
        out[factor] = tuple(_as_axes(v) for v in per_dim)
        for axes in out[factor]:
            for axis in axes:
                if axis not in mesh.axis_names:
                    raise ShardingError(
                        f"use_mesh: rule {factor!r} names mesh axis {axis!r}; the mesh has axes "
                        f"{tuple(mesh.axis_names)}"
                    )
    return out


@contextlib.contextmanager
def use_mesh(
    mesh: Any,
    axis_rules: Mapping[str, AxisRule | tuple[AxisRule, ...]] | None = None,
    *,
    over_conventions: bool = False,
) -> Iterator[MeshContext]:
    """Run kernel-hub's JAX functions called (or traced) in this block sharded over ``mesh``.

    ``axis_rules`` maps rule factors to mesh axes, e.g. ``{"batch": "data", "heads": "model",
    "...": ("data",)}`` (``...``: one entry per leading dimension of row-wise ops such as
    rms_norm). Factors without a rule stay unsplit. Needed on Auto-axis meshes, where traced
    arrays carry no sharding; on Explicit-axis meshes kernel-hub reads the arrays' own.
    ``over_conventions``: the rules are added to the mesh-axis conventions
    (``CONVENTIONAL_AXES``, what an Auto mesh gets outside ``use_mesh``), and like theirs a
    placement a dimension's size cannot take leaves that factor unsplit instead of failing.
    """
    rules = _normalised(mesh, axis_rules or {})
    if over_conventions:
        context = conventional_context(mesh)
        context = replace(context, rules={**context.rules, **rules})
    else:
        context = MeshContext(mesh, rules)
    token = _CURRENT.set(context)
    try:
        yield context
    finally:
        _CURRENT.reset(token)


CONVENTIONAL_AXES: Mapping[str, tuple[str, ...]] = {
    "batch": ("data", "dp", "fsdp", "batch"),
    f"{ELLIPSIS}0": ("data", "dp", "fsdp", "batch"),
    "heads": ("model", "tp", "tensor", "mp"),
    "kv_heads": ("model", "tp", "tensor", "mp"),
    "channels": ("model", "tp", "tensor", "mp"),
    "intermediate": ("model", "tp", "tensor", "mp"),
    "experts": ("ep", "expert"),
    "vocab": ("model", "tp", "tensor", "mp"),
}
"""Rule factor -> the mesh-axis names that split it on an Auto mesh without ``use_mesh``. A rule
factor not listed (a sequence, a contraction, ``hidden``) stays unsplit there."""


def conventional_context(mesh: Any) -> MeshContext:
    """The rules ``CONVENTIONAL_AXES`` gives ``mesh``: each listed factor split over the mesh
    axes of those names it has, in mesh order."""
    rules = {
        ELLIPSIS if factor.startswith(ELLIPSIS) else factor: (
            tuple(a for a in mesh.axis_names if a in names),
        )
        for factor, names in CONVENTIONAL_AXES.items()
    }
    return MeshContext(mesh, rules, conventional=True)


def current_mesh_context() -> MeshContext | None:
    """The innermost ``use_mesh`` region, if any."""
    return _CURRENT.get()
