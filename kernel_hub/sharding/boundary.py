"""``shard_map`` at a kernel's boundary, driven by the op's ``ShardingRule``.

A Pallas call cannot be partitioned automatically: on an Explicit-axis mesh it fails at trace time,
on an Auto-axis mesh at Mosaic lowering (CPU interpret mode runs anyway, which hides the bug). So a
decorated JAX function, called with arrays sharded over a mesh (or inside ``use_mesh``), runs as
one ``jax.shard_map`` over *all* mesh axes (Mosaic needs every axis manual), with specs solved
from the rule. The input placement comes from the arrays' types on an Explicit mesh, from
``use_mesh``'s rules, from a concrete array's own sharding, or, for a traced array on an Auto mesh
(whose type carries the mesh but no spec), from the mesh-axis naming conventions
(``context.CONVENTIONAL_AXES``); the partitioner reshards an input placed otherwise, and the
collective shows in the compiled program. Outside a mesh, or inside a caller's ``shard_map``
(every axis already manual), it runs unchanged. The backward is ``shard_map``'s transpose, so
replicated weights get their gradient summed over the shards.

``jax.experimental.custom_partitioning`` would let the partitioner hand the kernel the shardings
it chose instead of a convention, but it does not compile for TPU in JAX 0.10 (libtpu: "Custom
emitter for CustomSPMDPartitioning not found", deviceless and on chips, jax-ml/jax#38196), and
its program cannot be ``jax.export``ed (TorchTPU's path).

``check_vma=False``: the kernels' ``pallas_call`` out_shapes carry no manual-axis types, and the
CPU interpreter rejects them when they do (research/distributed.md §1). The out specs come from
the rule alone; the sharded tests compare every output and gradient with the unsharded call,
which is what catches a wrong rule.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import math
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from .context import conventional_context, current_mesh_context
from .rule import ShardingError, ShardingRule
from .solve import Axes, Operand, Solution, expand, solve

RuleSource = ShardingRule | Callable[..., ShardingRule]
"""A rule, or a function of the call's keyword options returning one (e.g. a layout flag); one
that takes ``ranks`` also gets the ranks of the call's leading array arguments (see
``choose_rule``)."""

_RULES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Function made by ``sharded`` -> its rule (see ``rule_of``)."""


def rule_of(fn: Callable[..., Any]) -> RuleSource | None:
    """The rule ``fn`` runs under when ``sharded`` made it, else None (it runs as called)."""
    try:
        return _RULES.get(fn)
    except TypeError:  # not weak-referenceable, so not made by ``sharded``
        return None


def choose_rule(
    rule: RuleSource, options: Mapping[str, Any], ranks: Sequence[int | None]
) -> ShardingRule:
    """The rule of one call: ``rule`` itself, or what it gives for the call's keyword
    ``options`` and, when it takes ``ranks``, the ranks of the call's arguments in parameter
    order (None: absent or not an array), for operands whose rank varies with a format (a
    quantized weight's per-channel or per-block scale)."""
    if isinstance(rule, ShardingRule):
        return rule
    if _takes_ranks(rule):
        return rule(**options, ranks=tuple(ranks))
    return rule(**options)


@functools.cache
def _takes_ranks(rule: Callable[..., ShardingRule]) -> bool:
    return "ranks" in inspect.signature(rule).parameters


def partition_spec(per_dim: Sequence[Axes]) -> Any:
    """A ``PartitionSpec`` from per-dimension mesh axes."""
    from jax.sharding import PartitionSpec

    return PartitionSpec(*[None if not a else a[0] if len(a) == 1 else a for a in per_dim])


def _spec_axes(spec: Any, rank: int) -> tuple[Axes, ...]:
    entries = tuple(spec) + (None,) * (rank - len(spec))
    return tuple(() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in entries)


def _mesh_of(arrays: Sequence[Any], op: str) -> Any:
    """The one mesh the arrays are sharded over (None: no mesh); the manual check is separate."""
    import jax

    meshes = []
    for array in arrays:
        mesh = jax.typeof(array).sharding.mesh
        if not mesh.empty and all(m != mesh for m in meshes):
            meshes.append(mesh)
    if len(meshes) > 1:
        raise ShardingError(f"{op}: arrays are sharded over different meshes: {meshes}")
    return meshes[0] if meshes else None


def _axis_kinds(mesh: Any) -> set[str]:
    return {str(t).rsplit(".", 1)[-1] for t in mesh.axis_types}


def _placement(rule: ShardingRule, names: Sequence[str], arrays: Sequence[Any]):
    """(mesh, operands with their current per-dimension axes, explicit) or None: run unwrapped."""
    import jax
    from jax.sharding import NamedSharding

    found = find_mesh(rule.op, arrays)
    if found is None:
        return None
    mesh, explicit = found
    context = current_mesh_context()
    if context is None and not explicit:
        context = conventional_context(mesh)

    def axes(name: str, array: Any, dims: tuple[str, ...]) -> tuple[Axes, ...]:
        if context is None:
            return _spec_axes(jax.typeof(array).sharding.spec, array.ndim)
        concrete = not isinstance(array, jax.core.Tracer)
        sharding = getattr(array, "sharding", None) if concrete else None
        if context.conventional and isinstance(sharding, NamedSharding):
            return _spec_axes(sharding.spec, array.ndim)  # a concrete array: its own placement
        return tuple(context.axes_of(f) for f in expand(rule, dims, array.ndim, name))

    operands = [
        None if a is None else Operand(n, tuple(a.shape), axes(n, a, dims))
        for n, a, dims in zip(names, arrays, rule.operands, strict=True)
    ]
    if context is not None and context.conventional:
        operands = _divisible(rule, operands, mesh)
    return mesh, operands, explicit


def _divisible(rule: ShardingRule, operands: list[Operand | None], mesh: Any):
    """Conventional placements a factor's sizes cannot take dropped (that factor unsplit, with
    its grouped partner): they are a guess from the axis names, not the caller's request. A
    size-1 dimension the rule lets broadcast (``factor?``) is unsplit itself and drops nothing."""
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    dropped: set[str] = set()
    broadcast: set[tuple[int, int]] = set()
    for index, (operand, dims) in enumerate(zip(operands, rule.operands, strict=True)):
        if operand is None:
            continue
        rank = len(operand.shape)
        factors = expand(rule, dims, rank, operand.name)
        for dim, (factor, size, axes) in enumerate(
            zip(factors, operand.shape, operand.axes, strict=True)
        ):
            if size == 1 and rule.broadcasts(False, index, dim, rank):
                broadcast.add((index, dim))
            elif size % math.prod(sizes[a] for a in axes):
                dropped |= {factor, rule.partner(factor)} - {None}
    return [
        o
        if o is None
        else Operand(
            o.name,
            o.shape,
            tuple(
                () if f in dropped or (index, dim) in broadcast else a
                for dim, (f, a) in enumerate(
                    zip(expand(rule, d, len(o.shape), o.name), o.axes, strict=True)
                )
            ),
        )
        for index, (o, d) in enumerate(zip(operands, rule.operands, strict=True))
    ]


def run_sharded(
    rule: ShardingRule,
    fn: Callable[..., Any],
    names: Sequence[str],
    arrays: Sequence[Any],
    options: dict[str, Any],
) -> Any:
    """``fn(*arrays, **options)``, as one shard_map over the arrays' mesh when there is one."""
    placement = _placement(rule, names, arrays)
    if placement is None:
        return fn(*arrays, **options)
    mesh, operands, explicit = placement
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    solution = solve(rule, operands, sizes, _result_shapes(rule, fn, arrays, options))
    return _shard_mapped(rule, fn, mesh, arrays, solution, options, explicit)


_BYPASSED: contextvars.ContextVar[bool] = contextvars.ContextVar("kernel_hub_bypass", default=False)


@contextlib.contextmanager
def bypassed() -> Iterator[None]:
    """Kernels called in this block skip the boundary (run unwrapped): the negative control of
    the sharded compile checks, showing what Mosaic does without it."""
    token = _BYPASSED.set(True)
    try:
        yield
    finally:
        _BYPASSED.reset(token)


def _result_shapes(rule: ShardingRule, fn, arrays, options):
    """The results' global shapes (None: an absent result), for rules whose results may
    broadcast; traced on unsharded stand-ins, so no kernel is placed."""
    import jax

    if not rule.broadcast_results:
        return None
    stand_ins = [None if a is None else jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays]
    out = jax.eval_shape(lambda *a: fn(*a, **options), *stand_ins)
    out = (out,) if len(rule.results) == 1 else out
    return [None if o is None else tuple(o.shape) for o in out]


def find_mesh(op: str, arrays: Sequence[Any]) -> tuple[Any, bool] | None:
    """(mesh, explicit) a layer built on shard_map runs over: the ``use_mesh`` region's, else the
    mesh the arrays are sharded on (Explicit or Auto axes); None outside any mesh or inside a
    shard_map over every axis."""
    if _BYPASSED.get():
        return None
    context = current_mesh_context()
    mesh = _mesh_of([a for a in arrays if a is not None], op)
    if mesh is not None and "Manual" in _axis_kinds(mesh):
        if _axis_kinds(mesh) == {"Manual"}:
            return None  # inside the caller's shard_map: the kernel sees per-shard arrays
        raise ShardingError(
            f"{op}: called inside a shard_map over only some mesh axes "
            f"({mesh.axis_names}, {mesh.axis_types}); Pallas kernels need a shard_map over all "
            f"of them"
        )
    if context is not None:
        return context.mesh, "Explicit" in _axis_kinds(context.mesh)
    if mesh is None:
        return None
    return mesh, "Explicit" in _axis_kinds(mesh)


def shard_map_all(
    body: Callable[..., Any],
    mesh: Any,
    arrays: Sequence[Any],
    in_axes: Sequence[Sequence[Axes]],
    out_specs: Any,
    explicit: bool,
) -> Any:
    """``body`` as one shard_map over every axis of ``mesh`` (``check_vma=False``, see above).
    On an Explicit mesh, an array not already split as ``in_axes`` says is resharded first
    (shard_map does not reshard there)."""
    import jax
    from jax.sharding import NamedSharding

    if explicit:
        arrays = [
            a
            if _spec_axes(jax.typeof(a).sharding.spec, a.ndim) == tuple(want)
            else jax.sharding.reshard(a, NamedSharding(mesh, partition_spec(want)))
            for a, want in zip(arrays, in_axes, strict=True)
        ]
    mapped = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=tuple(partition_spec(a) for a in in_axes),
        out_specs=out_specs,
        check_vma=False,
    )
    return mapped(*arrays)


def _shard_mapped(rule, fn, mesh, arrays, solution: Solution, options, explicit):
    import jax

    present = [a for a in arrays if a is not None]
    reductions = solution.result_reductions
    single = len(rule.results) == 1

    def summed(result, axes):
        return result if result is None or not axes else jax.lax.psum(result, axes)

    told = rule.combined or rule.located
    combined = {"split_axes": solution.split_axes(rule)} if told else {}

    def body(*local):
        supplied = iter(local)
        full = [None if a is None else next(supplied) for a in arrays]
        out = fn(*full, **options, **combined)
        if single:
            return summed(out, reductions[0])
        return tuple(summed(r, axes) for r, axes in zip(out, reductions, strict=True))

    out_specs = tuple(partition_spec(r) for r in solution.results)
    out_specs = out_specs[0] if len(rule.results) == 1 else out_specs
    return shard_map_all(body, mesh, present, solution.operands, out_specs, explicit)


def sharded(rule: RuleSource) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: run a kernel's JAX function through ``run_sharded`` with ``rule``.

    The function's first ``len(rule.operands)`` parameters are its array operands (optional ones
    may be None); the rest are options, passed unchanged (plus ``split_axes`` when the rule has
    ``combined`` or ``located`` factors). ``rule_of`` gives the decorated
    function's rule, ``__wrapped__`` the plain function.
    """

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(fn)
        params = list(signature.parameters)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            arguments = bound.arguments
            ranks = [getattr(arguments.get(p), "ndim", None) for p in params]
            chosen = choose_rule(rule, kwargs, ranks)
            names = params[: len(chosen.operands)]
            arrays = [arguments.get(n) for n in names]
            options = {k: v for k, v in arguments.items() if k not in names}
            return run_sharded(chosen, fn, names, arrays, options)

        _RULES[wrapper] = rule
        return wrapper

    return decorate
