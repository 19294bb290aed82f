"""A kernel's options declared once, as one frozen dataclass, and the parameter lists derived
from it.

An attention-like kernel has a dozen static options (causal, window, soft-cap, scale, block
sizes, ...) that its public JAX functions take as keywords and its torch op stubs take as schema
parameters. Written out by hand, each list repeats the others, and adding an option means editing
every one of them. Instead the kernel declares the options as a frozen dataclass and derives:

* ``takes_options(Options)``: a JAX function written as ``fn(*arrays, options)`` gets the public
  signature ``fn(*arrays, *, <field>=<default>, ...)`` and receives one ``Options`` instance;
* ``option_stub(Options)``: a torch op stub written as ``stub(*tensors, options)`` gets the
  signature the bridge (``jax_op``) reads as the op's schema: the tensors and then the fields as
  plain parameters, and receives one ``Options`` instance.

The op then passes the fields to its JAX function as keywords, which ``jax_op`` checks by name
when the op is defined. A new field, declared last, becomes every op's last schema parameter, so
positional calls written against an earlier schema keep their meaning.

Attention-like kernels share the score options ``causal``, ``sliding_window``, ``softcap`` and
``scale``: ``check_score_options`` applies their value rules and ``resolved_scores`` the values
the kernels compute with, so each kernel's dataclass states only its own options.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import typing
from collections.abc import Callable, Sequence
from typing import Any

from .errors import KernelInputError

__all__ = [
    "check_score_options",
    "option_fields",
    "option_stub",
    "option_values",
    "resolved_scores",
    "takes_options",
]

_OPTIONS = "options"


def option_fields(options: type, exclude: Sequence[str] = ()) -> tuple[str, ...]:
    """The field names of the options dataclass ``options``, in declaration order, less
    ``exclude`` (options an op does not take; they keep their defaults)."""
    names = tuple(f.name for f in dataclasses.fields(options) if f.init)
    unknown = set(exclude) - set(names)
    if unknown:
        raise TypeError(f"{options.__name__} has no fields {sorted(unknown)}; fields: {names}")
    return tuple(n for n in names if n not in exclude)


def option_values(options: Any, exclude: Sequence[str] = ()) -> dict[str, Any]:
    """The fields of the options instance ``options`` (less ``exclude``) as keywords, to pass on
    to a function derived with ``takes_options`` or to a torch op."""
    return {n: getattr(options, n) for n in option_fields(type(options), exclude)}


def _parameters(options: type, names: Sequence[str], kind: Any) -> list[inspect.Parameter]:
    hints = typing.get_type_hints(options)
    defaults = {f.name: f.default for f in dataclasses.fields(options)}
    return [inspect.Parameter(n, kind, default=defaults[n], annotation=hints[n]) for n in names]


def _split(signature: inspect.Signature, name: str) -> list[inspect.Parameter]:
    """The parameters less the last one, which must be ``options``."""
    params = list(signature.parameters.values())
    if not params or params[-1].name != _OPTIONS:
        raise TypeError(f"{name}: its last parameter must be {_OPTIONS!r}")
    return params[:-1]


def takes_options(
    options: type, *, exclude: Sequence[str] = ()
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator of ``fn(*arrays, options)``: the returned function takes ``options``' fields
    (less ``exclude``) as keyword-only parameters and calls ``fn`` with one instance of it."""
    names = option_fields(options, exclude)

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        # evaluated annotations: ``kernel_api.op`` reads the torch schema from this signature
        signature = inspect.signature(fn, eval_str=True)
        params = _split(signature, fn.__name__)
        signature = signature.replace(
            parameters=[*params, *_parameters(options, names, inspect.Parameter.KEYWORD_ONLY)]
        )

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            chosen = {n: kwargs.pop(n) for n in names if n in kwargs}
            return fn(*args, **kwargs, options=options(**chosen))

        wrapper.__signature__ = signature  # type: ignore[attr-defined]
        return wrapper

    return decorate


def option_stub(
    options: type,
    *,
    exclude: Sequence[str] = (),
    leading: Sequence[str] = (),
    after: str | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator of a torch op stub ``stub(*tensors, options)``: the returned stub's parameters
    (the op's schema) are the tensors and ``options``' fields (less ``exclude``) as plain
    parameters. The fields of ``leading`` the op takes, in that order, follow the argument
    ``after`` (positions an earlier schema fixed); every other field follows the last argument,
    in declaration order."""
    names = option_fields(options, exclude)
    option_fields(options, exclude=leading)  # a leading name that is no field raises here
    leading = [n for n in leading if n in names]
    trailing = [n for n in names if n not in leading]
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD

    def decorate(stub: Callable[..., Any]) -> Callable[..., Any]:
        # evaluated annotations: the bridge reads the schema's types from this signature
        signature = inspect.signature(stub, eval_str=True)
        own = _split(signature, stub.__name__)
        own_names = [p.name for p in own]
        if after is not None and after not in own_names:
            raise TypeError(f"{stub.__name__}: after={after!r} names none of {own_names}")
        cut = len(own) if after is None else own_names.index(after) + 1
        params = [
            *own[:cut],
            *_parameters(options, leading, kind),
            *own[cut:],
            *_parameters(options, trailing, kind),
        ]
        signature = signature.replace(parameters=params)

        @functools.wraps(stub)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            values = bound.arguments
            chosen = options(**{n: values[n] for n in names})
            return stub(**{n: values[n] for n in own_names}, options=chosen)

        wrapper.__signature__ = signature  # type: ignore[attr-defined]
        return wrapper

    return decorate


def check_score_options(options: Any, owner: str) -> None:
    """The value rules of the score options (each may be None): ``sliding_window`` an integer
    >= 1, ``softcap`` a finite number > 0, ``scale`` finite. ``KernelInputError`` naming
    ``owner``, the option, its value and what is valid."""
    window, softcap, scale = options.sliding_window, options.softcap, options.scale
    if window is not None and not (isinstance(window, int) and window >= 1):
        raise KernelInputError(
            f"{owner}: sliding_window={window!r}; it must be an integer >= 1 (keys with 0 <= "
            f"query position - key position < sliding_window are kept) or None"
        )
    if softcap is not None and not (math.isfinite(softcap) and softcap > 0):
        raise KernelInputError(
            f"{owner}: softcap={softcap!r}; it must be a finite number > 0 or None"
        )
    if scale is not None and not math.isfinite(scale):
        raise KernelInputError(f"{owner}: scale={scale!r}; it must be finite or None")


def resolved_scores(options: Any, head_dim: int) -> dict[str, Any]:
    """``causal``, ``softcap`` and ``scale`` as the kernels compute with them (a bool, floats,
    the default scale 1/sqrt(head_dim) filled in), for ``dataclasses.replace``."""
    softcap, scale = options.softcap, options.scale
    return {
        "causal": bool(options.causal),
        "softcap": None if softcap is None else float(softcap),
        "scale": float(head_dim**-0.5 if scale is None else scale),
    }
