"""Solve a rule against the inputs' shardings: one set of mesh axes per factor, or an error.

Inputs are given as per-dimension mesh axes (what a ``PartitionSpec`` holds). A factor takes the
axes of whichever operand splits it; an operand that holds the factor unsplit is split to match
(a local slice, no communication). Anything else is a ``ShardingError`` that names the factor,
the operand and dimension, the mesh axes and, where the rule knows one, the layer to use instead.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .rule import ELLIPSIS, ShardingError, ShardingRule

Axes = tuple[str, ...]
"""The mesh axes one dimension is split over, major to minor; () = unsplit."""


@dataclass(frozen=True)
class Operand:
    """One array argument: its name (for messages), shape and per-dimension mesh axes."""

    name: str
    shape: tuple[int, ...]
    axes: tuple[Axes, ...]


@dataclass(frozen=True)
class Solution:
    """Per-dimension mesh axes of every present operand and of every result, and per result the
    axes it is summed over: those of every split factor the result does not hold, except
    ``combined`` ones (``reduced`` factors, and einsum-style a factor other results keep, e.g.
    the sinks' gradient summed over a split batch)."""

    operands: tuple[tuple[Axes, ...], ...]
    results: tuple[tuple[Axes, ...], ...]
    result_reductions: tuple[Axes, ...]
    factor_axes: Mapping[str, Axes]

    def split_axes(self, rule: ShardingRule) -> dict[str, Axes]:
        """The rule's ``combined`` and ``located`` factors that are split, with their mesh axes
        (what the function is told as ``split_axes``)."""
        told = rule.combined | rule.located
        return {f: a for f, a in self.factor_axes.items() if f in told}


def expand(rule: ShardingRule, dims: tuple[str, ...], rank: int, name: str) -> tuple[str, ...]:
    """The factor of every dimension of a rank-``rank`` array read as ``dims``."""
    fixed = [d for d in dims if d != ELLIPSIS]
    leading = rank - len(fixed)
    if leading < 0 or (leading and ELLIPSIS not in dims):
        raise ShardingError(
            f"{rule.op}: {name} has rank {rank}; its sharding rule reads it as [{' '.join(dims)}]"
        )
    if ELLIPSIS not in dims:
        return tuple(fixed)
    return tuple(f"{ELLIPSIS}{i}" for i in range(leading)) + tuple(fixed)


def _where(operand: Operand, dim: int) -> str:
    return f"{operand.name} dimension {dim} (size {operand.shape[dim]})"


def _hint(rule: ShardingRule, factor: str) -> str:
    layer = rule.handled_by.get(factor)
    return f"; to shard it use {layer}" if layer else ""


def solve(
    rule: ShardingRule,
    operands: Sequence[Operand | None],
    mesh_sizes: Mapping[str, int],
    result_shapes: Sequence[tuple[int, ...] | None] | None = None,
) -> Solution:
    """Mesh axes for every dimension of the operands (None: absent optional) and results.

    ``result_shapes`` are needed only by rules with broadcasting result dimensions (``factor?``):
    one of size 1 is unsplit and summed over its factor's axes."""
    if len(operands) != len(rule.operands):
        raise ShardingError(
            f"{rule.op}: {len(operands)} array arguments, its rule has {len(rule.operands)}"
        )
    present = [
        (o, dims, i)
        for i, (o, dims) in enumerate(zip(operands, rule.operands, strict=True))
        if o is not None
    ]
    expanded = [expand(rule, dims, len(o.shape), o.name) for o, dims, _ in present]
    ellipsis_ranks = {
        sum(f.startswith(ELLIPSIS) for f in e)
        for e, (_, d, _) in zip(expanded, present, strict=True)
        if ELLIPSIS in d
    }

    def broadcast(index: int, operand: Operand, dim: int) -> bool:
        rank = len(operand.shape)
        return operand.shape[dim] == 1 and rule.broadcasts(False, index, dim, rank)

    if len(ellipsis_ranks) > 1:
        raise ShardingError(f"{rule.op}: the '...' dimensions differ in count between operands")

    factor_axes: dict[str, Axes] = {}
    seen_at: dict[str, str] = {}
    for (operand, _, index), factors in zip(present, expanded, strict=True):
        for dim, (factor, axes) in enumerate(zip(factors, operand.axes, strict=True)):
            if not axes or broadcast(index, operand, dim):
                continue
            base = factor if not factor.startswith(ELLIPSIS) else ELLIPSIS
            if base in rule.whole:
                raise ShardingError(
                    f"{rule.op}: {_where(operand, dim)} is split over mesh axes {axes}, but its "
                    f"factor {factor!r} must stay whole{_hint(rule, factor)}; replicate it "
                    f"(in_specs None there)"
                )
            previous = factor_axes.get(factor)
            if previous is not None and previous != axes:
                raise ShardingError(
                    f"{rule.op}: factor {factor!r} is split over {previous} in {seen_at[factor]} "
                    f"but over {axes} in {_where(operand, dim)}; split both the same way"
                )
            factor_axes[factor] = axes
            seen_at[factor] = _where(operand, dim)

    for a, b in rule.together:
        axes_a, axes_b = factor_axes.get(a), factor_axes.get(b)
        if axes_a is not None and axes_b is not None and axes_a != axes_b:
            raise ShardingError(
                f"{rule.op}: factors {a!r} and {b!r} are split together (grouped heads); got "
                f"{axes_a} in {seen_at[a]} and {axes_b} in {seen_at[b]}"
            )
        axes = axes_a or axes_b
        if axes:
            factor_axes[a] = factor_axes[b] = axes

    users: dict[str, str] = {}
    for factor, axes in factor_axes.items():
        for axis in axes:
            if axis not in mesh_sizes:
                raise ShardingError(f"{rule.op}: mesh axis {axis!r} is not in {dict(mesh_sizes)}")
            other = users.get(axis)
            if other is not None and rule.partner(factor) != other:
                raise ShardingError(
                    f"{rule.op}: mesh axis {axis!r} splits both factor {other!r} and {factor!r}; "
                    f"one mesh axis may split one factor"
                )
            users[axis] = factor

    operand_axes = []
    for (operand, _, index), factors in zip(present, expanded, strict=True):
        per_dim = []
        for dim, factor in enumerate(factors):
            axes = () if broadcast(index, operand, dim) else factor_axes.get(factor, ())
            count = math.prod(mesh_sizes[a] for a in axes)
            if operand.shape[dim] % count:
                raise ShardingError(
                    f"{rule.op}: {_where(operand, dim)} (factor {factor!r}) cannot be split "
                    f"{count} ways over mesh axes {axes}; it must be divisible by {count}"
                )
            per_dim.append(axes)
        operand_axes.append(tuple(per_dim))

    leading = next(iter(ellipsis_ranks), 0)
    results, reductions = [], []
    for index, dims in enumerate(rule.results):
        names = [f"{ELLIPSIS}{i}" for i in range(leading)] if ELLIPSIS in dims else []
        names += [d for d in dims if d != ELLIPSIS]
        shape = result_shapes[index] if result_shapes is not None else None
        summed = {
            f
            for dim, f in enumerate(names)
            if shape is not None
            and shape[dim] == 1
            and rule.broadcasts(True, index, dim, len(names))
        }
        results.append(tuple(() if f in summed else factor_axes.get(f, ()) for f in names))
        held = ({rule.partner(f) for f in names} | set(names)) - summed
        summed_factors = [f for f in sorted(factor_axes) if f not in held | rule.combined]
        reductions.append(tuple(a for f in summed_factors for a in factor_axes[f]))
    return Solution(tuple(operand_axes), tuple(results), tuple(reductions), factor_axes)
