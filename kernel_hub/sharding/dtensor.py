"""DTensor sharding strategies from an op's ``ShardingRule`` (``register_sharding``).

For one mesh dimension each strategy splits one factor (with its grouped partner): operands
holding it are ``Shard(dim)``, the others ``Replicate()``; results holding it are ``Shard(dim)``,
and results without it (a ``reduced`` factor, or einsum-style a factor only other results keep)
are ``Partial()`` (each rank holds a partial sum); ``combined`` and ``located`` factors are never
split. All-
replicate is always offered. DTensor expands these over every mesh dimension and redistributes
inputs to the cheapest one. The backward op gets the matching strategies: gradients of operands
that lack the split factor (replicated weights) come out ``Partial()``, summed when used.
An operand that broadcasts the split factor (a size-1 ``factor?`` dimension, such as a
[1, H, Sq, Sk] mask's batch) is ``Replicate()`` and its gradient ``Partial()``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .rule import ELLIPSIS, ShardingRule
from .solve import expand

Strategy = tuple[list[Any], list[Any]]
Shape = tuple[int, ...]


def _leading(rule: ShardingRule, ranks: Sequence[int | None]) -> int:
    for dims, rank in zip(rule.operands, ranks, strict=True):
        if rank is not None and ELLIPSIS in dims:
            return rank - (len(dims) - 1)
    return 0


def _expanded(rule: ShardingRule, ranks: Sequence[int | None], shapes=None):
    """Factor names per dimension of each operand (None: absent) and of each result. With
    ``shapes``, an operand's size-1 broadcasting dimension is named "" (it holds no factor: the
    operand stays whole there, and its gradient is a partial sum)."""
    operands = [
        None if r is None else list(expand(rule, d, r, f"operand {i}"))
        for i, (d, r) in enumerate(zip(rule.operands, ranks, strict=True))
    ]
    for index, (dims, shape) in enumerate(
        zip(operands, shapes or [None] * len(ranks), strict=True)
    ):
        for dim in range(len(shape or ())):
            if shape[dim] == 1 and rule.broadcasts(False, index, dim, len(shape)):
                dims[dim] = ""
    leading = [f"{ELLIPSIS}{i}" for i in range(_leading(rule, ranks))]
    results = [
        tuple((leading if ELLIPSIS in d else []) + [f for f in d if f != ELLIPSIS])
        for d in rule.results
    ]
    return [None if d is None else tuple(d) for d in operands], results


def split_factors(rule: ShardingRule, ranks: Sequence[int | None]) -> list[frozenset[str]]:
    """The factor groups a strategy may split: free ones, a grouped pair counted once."""
    operands, _ = _expanded(rule, ranks)
    seen: list[frozenset[str]] = []
    for dims in operands:
        for factor in dims or ():
            base = ELLIPSIS if factor.startswith(ELLIPSIS) else factor
            if not factor or base in rule.whole | rule.combined:
                continue
            group = frozenset({factor} | ({rule.partner(factor)} - {None}))
            if group & rule.located:  # a grouped partner's offset is needed as much
                continue
            if group not in seen:
                seen.append(group)
    return seen


def _place(dims: Sequence[str] | None, group: frozenset[str], otherwise: Any) -> Any:
    from torch.distributed.tensor import Shard

    if dims is None:
        return None
    for index, factor in enumerate(dims):
        if factor in group:
            return Shard(index)
    return otherwise


def forward_strategies(
    rule: ShardingRule, ranks: Sequence[int | None], shapes: Sequence[Shape | None] | None = None
) -> list[Strategy]:
    """(result placements, operand placements) pairs for one mesh dimension."""
    from torch.distributed.tensor import Partial, Replicate

    operands, results = _expanded(rule, ranks, shapes)
    out = [([Replicate()] * len(results), [None if d is None else Replicate() for d in operands])]
    for group in split_factors(rule, ranks):
        out.append(
            (
                [_place(r, group, Partial()) for r in results],
                [_place(d, group, Replicate()) for d in operands],
            )
        )
    return out


def backward_strategies(
    rule: ShardingRule,
    ranks: Sequence[int | None],
    differentiable: Sequence[int],
    shapes: Sequence[Shape | None] | None = None,
) -> list[Strategy]:
    """(gradient placements, inputs + outputs + cotangents placements) for the backward op.
    Reduced factors are not offered (their cotangents would need to be replicated anyway)."""
    from torch.distributed.tensor import Replicate

    operands, results = _expanded(rule, ranks, shapes)
    everything = [*operands, *results, *results]
    replicated = [None if d is None else Replicate() for d in everything]
    out = [([Replicate()] * len(differentiable), replicated)]
    for group in split_factors(rule, ranks):
        if group & rule.reduced:
            continue
        out.append(
            (
                [_gradient_place(operands[i], group) for i in differentiable],
                [_place(d, group, Replicate()) for d in everything],
            )
        )
    return out


def _gradient_place(dims: Sequence[str] | None, group: frozenset[str]) -> Any:
    """An operand's gradient: split like the operand, else a partial sum; an absent optional
    operand gets an empty placeholder gradient, replicated."""
    from torch.distributed.tensor import Partial, Replicate

    return Replicate() if dims is None else _place(dims, group, Partial())


def _shape(value: Any) -> Shape | None:
    return None if value is None else tuple(value.shape)


def _rank(value: Any) -> int | None:
    return None if value is None else len(value.shape)


def register(
    op: Any,
    backward_op: Any | None,
    rule_for: Callable[[dict[str, Any], Sequence[int | None]], ShardingRule],
    param_names: Sequence[str],
    tensor_params: Sequence[str],
    differentiable: Sequence[str],
) -> None:
    """Register DTensor strategies for a bridged op (and its backward op) from its rule.

    ``rule_for(static_arguments, tensor_ranks)`` picks the rule for a call's options (and its
    tensors' ranks, None for an absent one).
    """
    from torch.distributed.tensor.experimental import register_sharding

    static_params = [p for p in param_names if p not in tensor_params]
    diff_index = [tensor_params.index(p) for p in differentiable]

    @register_sharding(op)
    def forward(*args: Any, **kwargs: Any) -> list[Strategy]:
        arguments = dict(zip(param_names, args, strict=False)) | kwargs
        static = {p: arguments[p] for p in static_params if p in arguments}
        ranks = [_rank(arguments.get(p)) for p in tensor_params]
        shapes = [_shape(arguments.get(p)) for p in tensor_params]
        strategies = []
        for results, placements in forward_strategies(rule_for(static, ranks), ranks, shapes):
            by_name = dict(zip(tensor_params, placements, strict=True))
            strategies.append((results, [by_name.get(p) for p in param_names[: len(args)]]))
        return strategies

    if backward_op is None:
        return

    @register_sharding(backward_op)
    def backward(inputs, outputs, cotangents, *static_values: Any) -> list[Strategy]:
        static = dict(zip(static_params, static_values, strict=False))
        ranks = [_rank(t) for t in inputs]
        shapes = [_shape(t) for t in inputs]
        strategies = backward_strategies(rule_for(static, ranks), ranks, diff_index, shapes)
        pad = [None] * len(static_values)
        return [(grads, [*placements, *pad]) for grads, placements in strategies]
