"""A kernel's options declared once, as one frozen dataclass, and the parameter lists derived
from it.

An attention-like kernel has a dozen static options (causal, window, soft-cap, scale, block
sizes, ...) that its public JAX functions take as keywords. Written out by hand, each list repeats
the others, and adding an option means editing every one of them. Instead the kernel declares the
options as a frozen dataclass, and ``takes_options(Options)`` gives a JAX function written as
``fn(*arrays, options)`` the public signature ``fn(*arrays, *, <field>=<default>, ...)``; it
receives one ``Options`` instance. Declared with ``kernel_api.op``, that signature is also the
torch op's schema: a new field, declared last, becomes the op's last schema parameter, so
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


def check_score_options(options: Any, owner: str) -> None:
    """The value rules of the score options (each may be None): ``sliding_window`` an integer
    >= 1, ``softcap`` a finite number > 0, ``scale`` finite. ``KernelInputError`` naming
    ``owner``, the option, its value and what is valid."""
    window, softcap, scale = options.sliding_window, options.softcap, options.scale
    if window is not None and not (
        isinstance(window, int) and not isinstance(window, bool) and window >= 1
    ):
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
