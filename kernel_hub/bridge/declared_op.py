"""An op declared once, on its public JAX function; kernel-hub derives the rest (``kernel_api.op``).

A kernel writes its public JAX function with typed parameters (arrays first, ``jax.Array`` or
``jax.Array | None``, then options with defaults, keyword-only or not) and decorates it::

    @op(
        check=check_inputs,  # called with the op's arguments of the same names
        differentiable=("x", "weight"),
        sharding=Einsum("... hidden, hidden -> ... hidden", whole=("hidden",)),
        jax_only=("block_rows",),  # options the torch op does not take
    )
    def rms_norm(x: jax.Array, weight: jax.Array, eps: float = 1e-6, *,
                 implementation: str | None = None, block_rows: int | None = None) -> jax.Array:
        return TABLE(x, weight, eps=eps, implementation=implementation, block_rows=block_rows)

From it come

* the public JAX function: ``check``, then the body, run under the sharding rule (``sharded``:
  one ``shard_map`` over the mesh the arrays are on, as before, so the check sees each shard);
* the torch custom op (``.torch`` of the returned function, a ``JaxOp``): its schema is the JAX
  signature in the same order and names, arrays as tensors, every option a plain parameter,
  less ``jax_only``; ``jax.Array`` results become tensors, ``jax.typing.DTypeLike`` a
  ``torch.dtype``. Its validation runs ``check`` (and ``torch_check``, for rules only tensors
  have: ``requires_grad``, readable CPU values) on the tensors before any JAX work;
* the op's DTensor strategies, from the same rule (``jax_op`` registers them).

A new option added last to the JAX signature is therefore the torch op's last parameter (positional
callers keep their meaning) and reaches the sharding rule among the call's options. Where a
published torch schema put parameters elsewhere (options before arrays added later),
``torch_after={"argument": ("option", ...)}`` keeps them right after ``argument`` in the torch op.

A JAX function taking an options dataclass (``takes_options``) is declared the same way: its
public signature lists the dataclass's fields as keyword parameters.
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import torch

from ..sharding import ShardingRule, sharded
from ..sharding.boundary import RuleSource
from ..sharding.rule import Einsum
from .buckets import RowBuckets
from .op_spec import JaxBackward
from .torch_op import JaxOp, jax_op, op_namespace

__all__ = ["Sharding", "op"]

Sharding = ShardingRule | Einsum | Callable[..., ShardingRule | Einsum]
"""An op's sharding: a rule, an ``Einsum`` (named after the op), or a function of the call's
options (and ``ranks``) returning either (see ``sharding.boundary.choose_rule``)."""

_ARRAY = jax.Array
_DTYPE = jax.typing.DTypeLike


def _torch_type(annotation: Any, where: str) -> Any:
    """The torch annotation of a JAX one: arrays -> tensors (also inside ``X | None`` and
    tuples), dtypes -> ``torch.dtype``; Python scalars and strings as they are."""
    if annotation is inspect.Parameter.empty:
        raise TypeError(f"{where} has no type annotation; a declared op's parameters are typed")
    if annotation is _ARRAY:
        return torch.Tensor
    if annotation == (_ARRAY | None):
        return torch.Tensor | None
    if annotation == (_DTYPE | None):
        return torch.dtype | None
    if typing.get_origin(annotation) is tuple:
        return tuple.__class_getitem__(
            tuple(_torch_type(a, where) for a in typing.get_args(annotation))
        )
    return annotation


def _call_by_name(check: Callable[..., Any] | None) -> Callable[[dict[str, Any]], None]:
    """``check`` called with the arguments named as its parameters (none when it is None)."""
    if check is None:
        return lambda arguments: None
    names = list(inspect.signature(check).parameters)
    return lambda arguments: check(**{n: arguments[n] for n in names if n in arguments})


def _rule_source(name: str, sharding: Sharding) -> RuleSource:
    """``sharding`` as ``sharded`` takes it, ``Einsum``s named after the op."""
    if isinstance(sharding, Einsum):
        return sharding.rule(name)
    if isinstance(sharding, ShardingRule):
        return sharding

    @functools.wraps(sharding)  # keeps the signature: ``choose_rule`` looks for ``ranks``
    def chosen(**options: Any) -> ShardingRule:
        rule = sharding(**options)
        return rule.rule(name) if isinstance(rule, Einsum) else rule

    return chosen


def _moved(
    name: str, params: list[inspect.Parameter], torch_after: Mapping[str, Sequence[str]]
) -> list[inspect.Parameter]:
    """``params`` with each ``torch_after`` entry's parameters right after the named one."""
    by_name = {p.name: p for p in params}
    moved = [n for names in torch_after.values() for n in names]
    unknown = (set(torch_after) | set(moved)) - set(by_name)
    if unknown:
        raise TypeError(f"{name}: torch_after names no torch parameter: {sorted(unknown)}")
    ordered = []
    for p in params:
        if p.name not in moved:
            ordered.append(p)
            ordered.extend(by_name[n] for n in torch_after.get(p.name, ()))
    return ordered


def _torch_signature(
    name: str,
    signature: inspect.Signature,
    jax_only: Sequence[str],
    torch_required: Sequence[str],
    torch_after: Mapping[str, Sequence[str]],
) -> inspect.Signature:
    params = list(signature.parameters.values())
    unknown = (set(jax_only) | set(torch_required)) - {p.name for p in params}
    if unknown:
        raise TypeError(f"{name}: jax_only / torch_required name no parameter: {sorted(unknown)}")
    kept = []
    for p in params:
        if p.name in jax_only:
            if p.default is inspect.Parameter.empty:
                raise TypeError(f"{name}: jax_only parameter {p.name} needs a default")
            continue
        annotation = _torch_type(p.annotation, f"{name}({p.name})")
        default = p.default
        if p.name in torch_required:
            if annotation != (torch.Tensor | None):
                raise TypeError(f"{name}: torch_required names {p.name}, not an optional array")
            annotation, default = torch.Tensor, inspect.Parameter.empty
        kept.append(
            p.replace(
                kind=inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=annotation, default=default
            )
        )
    returns = _torch_type(signature.return_annotation, f"{name}'s result")
    return inspect.Signature(_moved(name, kept, torch_after), return_annotation=returns)


def op(
    *,
    check: Callable[..., Any] | None = None,
    torch_check: Callable[..., Any] | None = None,
    check_values: Callable[..., Any] | None = None,
    differentiable: Sequence[str] = (),
    sharding: Sharding | None = None,
    jax_only: Sequence[str] = (),
    torch_required: Sequence[str] = (),
    torch_after: Mapping[str, Sequence[str]] | None = None,
    jax_backward: JaxBackward | None = None,
    buckets: RowBuckets | None = None,
    autocast: Sequence[str] = (),
    frozen: Sequence[str] = (),
    name: str | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator declaring a kernel op on its public JAX function (see the module doc).

    ``check(**named arguments)``: the input check shared by the JAX function and the torch op.
    ``torch_check``: a check only the torch op runs (on tensors). ``check_values(**named
    arguments)``: a check of values (``kernel_api.host_values``) that runs on every call of both,
    where ``check`` runs once per signature in the torch op's eager calls. ``differentiable``,
    ``jax_backward``, ``buckets``, ``autocast`` and ``frozen`` are ``jax_op``'s. ``sharding``: the
    op's rule (an ``Einsum``, a ``ShardingRule`` or a rule function; None: no boundary).
    ``jax_only``: options the torch op leaves at their defaults (block sizes, configs).
    ``torch_required``: optional arrays the torch op requires (an op per affine form).
    ``torch_after``: ``{argument: names}``, torch parameters kept right after ``argument`` (where a
    published schema has them); the others keep the JAX order.
    ``name``: the torch op's name (default: the function's). Returns the public JAX function;
    its ``.torch`` is the torch op.
    """

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        op_name = name or fn.__name__
        signature = inspect.signature(fn, eval_str=True)
        validate = _call_by_name(check)
        validate_torch = _call_by_name(torch_check)
        validate_values = _call_by_name(check_values)

        @functools.wraps(fn)
        def checked(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            validate(bound.arguments)
            validate_values(bound.arguments)
            return fn(*args, **kwargs)

        public = checked if sharding is None else sharded(_rule_source(op_name, sharding))(checked)
        torch_signature = _torch_signature(
            op_name, signature, jax_only, torch_required, torch_after or {}
        )

        def stub(*args: Any, **kwargs: Any) -> None:
            bound = torch_signature.bind(*args, **kwargs)
            bound.apply_defaults()
            arguments = bound.arguments
            validate(arguments)
            validate_torch(arguments)

        stub.__signature__ = torch_signature  # type: ignore[attr-defined]
        stub.__name__ = stub.__qualname__ = op_name
        stub.__module__ = fn.__module__
        stub.__doc__ = fn.__doc__
        torch_op: JaxOp = jax_op(
            op_namespace(fn.__module__),
            public,
            differentiable=differentiable,
            jax_backward=jax_backward,
            buckets=buckets,
            autocast=autocast,
            frozen=frozen,
            check_values=None if check_values is None else lambda **a: validate_values(a),
        )(stub)
        public.torch = torch_op  # type: ignore[attr-defined]
        return public

    return decorate
