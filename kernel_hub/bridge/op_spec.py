"""What a bridged op computes: its parameters and its JAX forward and backward functions.

``bridge.py`` builds an ``OpSpec`` from a kernel's stub; ``executor.py`` runs it.
"""

from __future__ import annotations

import collections.abc
import functools
import inspect
import numbers
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kernel_hub.dispatch import order_generation

from .buckets import RowBuckets

JaxBackward = Callable[..., Sequence[Any]]


@dataclass(frozen=True)
class SavedBackward:
    """A JAX backward written as a plain function: ``fn(*tensors, *saved, **static)`` takes the
    op's tensor arguments, then the forward's outputs and their cotangents (``saved`` names them,
    in that order) positionally, and the op's other arguments as keywords. Unlike a bare
    ``JaxBackward`` it can be checked by name (``jax_op`` does, as it checks the forward)."""

    fn: Callable[..., Sequence[Any]]
    saved: tuple[str, ...]

    def __call__(self, inputs: dict, outputs: tuple, cotangents: tuple, **static: Any):
        return self.fn(*inputs.values(), *outputs, *cotangents, **static)


Static = tuple[Any, ...]  # the op's non-tensor arguments, in parameter order, made hashable


def hashable(value: Any) -> Any:
    """Lists (``int[]`` arguments) as tuples, so static arguments can key caches."""
    if isinstance(value, (list, tuple)):
        return tuple(hashable(v) for v in value)
    return value


@dataclass(frozen=True, eq=False)
class OpSpec:
    qualname: str
    signature: inspect.Signature
    tensor_params: tuple[str, ...]
    static_params: tuple[str, ...]
    differentiable: tuple[str, ...]
    jax_fn: Callable[..., Any]
    jax_backward: JaxBackward | None
    validate: Callable[..., Any]
    buckets: RowBuckets | None = None
    autocast: tuple[str, ...] = ()
    """Floating tensor arguments cast to the autocast dtype inside an autocast region (see
    ``autocast.py``); empty: the op runs in its inputs' dtypes, as autocast leaves it."""
    frozen: tuple[str, ...] = ()
    """Tensor arguments that get no gradient and may not ask for one in grad mode (``jax_op``)."""
    check_values: Callable[..., Any] | None = None
    """Run with every call's arguments by name before its kernel (``validate`` runs once per
    signature): checks of index values where they are on the host (``jax_op``)."""
    _jitted: dict = field(default_factory=dict, repr=False)

    @property
    def param_names(self) -> tuple[str, ...]:
        return tuple(self.signature.parameters)

    @property
    def list_static(self) -> bool:
        """Whether a non-tensor parameter takes a list (which must become a tuple to be a key)."""
        return any(
            _takes_sequence(self.signature.parameters[name].annotation)
            for name in self.static_params
        )

    def arguments(self, static: Static, tensors: Sequence[Any]) -> dict[str, Any]:
        """All arguments by name, from the static values and the tensors."""
        named = dict(zip(self.tensor_params, tensors, strict=True))
        named.update(zip(self.static_params, static, strict=True))
        return {name: named[name] for name in self.param_names}

    def jitted(self, role: str, static: Static) -> Callable[..., Any]:
        """The jitted forward (tensors...) or backward (inputs, outputs, cotangents) function.

        Keyed by the implementation order's generation too: a trace picks its implementation
        when it runs, and ``jax.jit`` would otherwise replay the old choice for shapes it has
        seen; functions of older generations are dropped."""
        generation = order_generation()
        key = (role, static, generation)
        fn = self._jitted.get(key)
        if fn is None:
            for stale in [k for k in list(self._jitted) if k[2] != generation]:
                self._jitted.pop(stale, None)  # another thread's first call may drop it too
            import jax

            kwargs = dict(zip(self.static_params, static, strict=True))
            if role == "forward":
                fn = jax.jit(functools.partial(self.jax_fn, **kwargs))
            else:
                fn = jax.jit(functools.partial(_vjp, self, kwargs))
            self._jitted[key] = fn
        return fn


_SCALARS: dict[Any, tuple[type, ...]] = {
    float: (numbers.Real,),  # numpy scalars too
    int: (numbers.Integral,),
    bool: (bool,),
    str: (str,),
}


def _expected(annotation: Any) -> tuple[tuple[type, ...], bool, str] | None:
    """The Python types a stub annotation accepts, whether None is one, and how to name them;
    None for annotations not checked here (sequences and anything unusual)."""
    import torch

    options = list(typing.get_args(annotation)) if _is_union(annotation) else [annotation]
    optional = type(None) in options
    options = [o for o in options if o is not type(None)]
    if len(options) != 1:
        return None
    (option,) = options
    if option is torch.Tensor:
        return (torch.Tensor,), optional, "a tensor"
    if option in _SCALARS:
        symbolic = {float: (torch.SymFloat, torch.SymInt), int: (torch.SymInt,)}.get(option, ())
        article = "an" if option.__name__[0] in "aeiou" else "a"
        return _SCALARS[option] + symbolic, optional, f"{article} {option.__name__}"
    return None


def check_argument_types(spec: OpSpec, arguments: dict[str, Any]) -> None:
    """``KernelInputError`` naming the argument, what it must be and what it got (``None`` for a
    weight, a string eps), before the stub's checks or any JAX tracing sees it."""
    for name, value in arguments.items():
        expected = _expected(spec.signature.parameters[name].annotation)
        if expected is None or (value is None and expected[1]):
            continue
        types_, optional, what = expected
        if not isinstance(value, types_):
            from kernel_hub.errors import KernelInputError

            op = spec.qualname.rpartition("::")[2]
            valid = f"{what} or None" if optional else what
            raise KernelInputError(
                f"{op}: {name} must be {valid}, got {type(value).__name__} {value!r:.60}"
            )


def _takes_sequence(annotation: Any) -> bool:
    """``list[int]``, ``Sequence[float] | None`` and the like."""
    options = typing.get_args(annotation) if _is_union(annotation) else (annotation,)
    return any(
        (typing.get_origin(option) or option) in (list, tuple, collections.abc.Sequence)
        for option in options
    )


def _is_union(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)


def present_differentiable(spec: OpSpec, inputs: Sequence[Any]) -> list[str]:
    """The differentiable arguments given as tensors (an optional one may be None): the backward
    returns one gradient for each, in this order."""
    named = dict(zip(spec.tensor_params, inputs, strict=True))
    return [name for name in spec.differentiable if named[name] is not None]


def _vjp(spec: OpSpec, static: dict[str, Any], inputs, outputs, cotangents):
    present = present_differentiable(spec, inputs)
    if spec.jax_backward is not None:
        named = dict(zip(spec.tensor_params, inputs, strict=True))
        grads = spec.jax_backward(named, tuple(outputs), tuple(cotangents), **static)
        by_name = dict(zip(spec.differentiable, grads, strict=True))
        return tuple(by_name[name] for name in present)
    import jax

    positions = [spec.tensor_params.index(name) for name in present]

    def forward(*diff_args):
        args = list(inputs)
        for position, value in zip(positions, diff_args, strict=True):
            args[position] = value
        return spec.jax_fn(*args, **static)

    primal_out, pullback = jax.vjp(forward, *(inputs[p] for p in positions))
    cotangent = tuple(cotangents) if isinstance(primal_out, tuple) else cotangents[0]
    return tuple(pullback(cotangent))
