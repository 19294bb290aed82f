"""When a bridged op may skip torch's dispatcher, and the cached direct call it then makes.

Entering an op through torch's dispatcher into a Python kernel costs ~8 us per call in a tight
loop and ~40 us inside a model (boxing the arguments, two Python kernels, cold caches); for small
ops that is a third of the call. For a plain eager call the dispatcher would only route to the
op's autograd kernel, which (nothing needing a gradient) calls the implementation: ``DirectCalls``
recognises exactly that case, so the op can make the same call itself.

A call is plain when nothing could observe or redirect the dispatch: no profiler, no
``torch.jit.trace``, no torch function or dispatch mode, no functorch transform, no tensor
subclass (fake, functional, ...), every tensor argument a CPU or CUDA tensor in a tensor
parameter's place and none needing a gradient, every other argument a non-tensor, and, for an op
with an autocast policy, no autocast region. Arguments given by keyword are put in their places
first (``positional``), so a caller may name its options: the fast path does not need a positional
call. The caller checks first that torch.compile is not tracing. Anything else goes through the
dispatcher as usual. ``KERNEL_HUB_DIRECT_CALLS=0`` sends every call through the dispatcher.

A direct call is cached per call signature (``find``/``remember``): the arguments' key holds the
number of arguments, the non-tensor arguments, each tensor's class, shape, dtype, device and (in
grad mode) ``requires_grad``, the grad mode, and the types of int and bool arguments (so ``2.0``
for an int is never taken for ``2``). Its first call is checked in full (``allowed``, then the op
validates and binds its executable); a repeat call checks the context (modes, profiler, tracing,
autocast: what ``plain`` checks), builds the key and makes one dictionary lookup, all in ``find``.
Entries go when an implementation order changes.
"""

from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kernel_hub.dispatch import watch_order

from .op_spec import hashable

_C = torch._C
_tls_includes = _C._dispatch_tls_local_include_set
_function_mode = _C._is_torch_function_mode_enabled
_profiling = torch.autograd._profiler_enabled
_jit_tracing = _C._get_tracing_state
_grad_enabled = _C.is_grad_enabled
_autocast_enabled = _C._is_any_autocast_enabled
_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
# Thread-local included dispatch keys with no mode or transform active (normal, inference mode).
# A dispatch mode adds Python, functorch its layer keys, the Python dispatcher its own.
_PLAIN_TLS_INCLUDES = (
    _C.DispatchKeySet(_C.DispatchKey.BackendSelect).add(_C.DispatchKey.ADInplaceOrView),
    _C.DispatchKeySet(_C.DispatchKey.BackendSelect),
)


DirectCall = Callable[[tuple], Any]
"""A cached direct call: takes the call's arguments in parameter order, returns the op's result."""


def _exact_type_params(params: Sequence[inspect.Parameter]) -> tuple[int, ...]:
    """Positions of int and bool parameters (optional or not): their values compare equal to
    values of types they refuse (``2.0 == 2``, ``1 == True``), so the key holds the type too."""
    exact = (int, bool, int | None, bool | None)
    return tuple(i for i, p in enumerate(params) if p.annotation in exact)


def _key_function(
    count: int,
    tensor_positions: frozenset[int],
    required_tensors: frozenset[int],
    exact_types: Sequence[int],
    list_static: bool,
) -> Callable[[tuple], tuple]:
    """The key of a call with ``count`` positional arguments, as one flat tuple expression.

    A repeat call's key is most of the Python a direct call adds, so it is compiled from source
    for its argument count (as ``dataclasses`` does for ``__init__``): no loop, no per-position
    test, no intermediate list. The source holds only positions and fixed names. A tensor that
    must be given contributes its attributes in place (a None there fails with AttributeError:
    not keyed); an optional one a nested tuple or None.
    """
    items = [str(count), "g"]
    for i in range(count):
        a = f"a{i}"
        if i in tensor_positions:
            fields = (
                f"{a}.__class__, {a}.shape, {a}.dtype, {a}.is_cpu or {a}.device, "
                f"g and {a}.requires_grad"
            )
            items.append(
                fields if i in required_tensors else f"None if {a} is None else ({fields})"
            )
        else:
            items.append(f"hashable({a})" if list_static else a)
    items += [f"a{i}.__class__" for i in exact_types if i < count]
    unpack = "".join(f"a{i}, " for i in range(count))
    source = (
        "def key(args):\n"
        f"    {unpack or '()'} = args\n"
        "    g = grad_enabled()\n"
        f"    return ({', '.join(items)},)\n"
    )
    namespace = {"grad_enabled": _grad_enabled, "hashable": hashable}
    exec(source, namespace)  # the source holds positions and fixed names only
    return namespace["key"]


class DirectCalls:
    """Decides, per call of one op, whether it may call its implementation directly, and keeps
    the direct calls already made, one per call signature."""

    def __init__(
        self,
        signature: inspect.Signature,
        tensor_params: Sequence[str],
        autocast: bool = False,
        list_static: bool = False,
    ):
        params = list(signature.parameters.values())
        names = [p.name for p in params]
        self._tensor_positions = frozenset(names.index(n) for n in tensor_params)
        self._autocast = autocast
        self._required = sum(p.default is inspect.Parameter.empty for p in params)
        self._count = len(params)
        # after n positional arguments: the (name, default) of each later parameter, their names,
        # and the names of those without a default (a call must name them)
        self._tails = [[(p.name, p.default) for p in params[n:]] for n in range(len(params) + 1)]
        self._tail_names = [frozenset(names[n:]) for n in range(len(params) + 1)]
        self._tail_required = [
            frozenset(p.name for p in params[n:] if p.default is inspect.Parameter.empty)
            for n in range(len(params) + 1)
        ]
        # (number of positional arguments, keyword names) -> that call's tail: keywords that bind
        self._bindings: dict[tuple, list[tuple[str, Any]]] = {}
        self.enabled = os.environ.get("KERNEL_HUB_DIRECT_CALLS", "1").strip() != "0"
        # per number of positional arguments: its key function (None below the required count)
        required_tensors = frozenset(
            names.index(n)
            for n in tensor_params
            if signature.parameters[n].annotation is torch.Tensor
        )
        exact_types = _exact_type_params(params)
        self._keys = [
            None
            if n < self._required
            else _key_function(
                n, self._tensor_positions, required_tensors, exact_types, list_static
            )
            for n in range(len(params) + 1)
        ]
        self._entries: dict[tuple, DirectCall] = {}
        watch_order(self)

    def positional(self, args: tuple, kwargs: dict) -> tuple | None:
        """Every argument in parameter order (defaults filled in), or None when the keywords do
        not bind (unknown, given twice, a required one missing): the dispatcher then says why."""
        shape = (len(args), *kwargs)
        tail = self._bindings.get(shape)
        if tail is None:
            n = len(args)
            if (
                n > self._count
                or not kwargs.keys() <= self._tail_names[n]
                or not self._tail_required[n] <= kwargs.keys()
            ):
                return None
            tail = self._bindings[shape] = self._tails[n]
        return args + tuple([kwargs.get(name, default) for name, default in tail])

    def plain(self) -> bool:
        """Direct calls are on and nothing that observes or redirects dispatch is active (the
        per-call part of ``allowed``)."""
        return (
            self.enabled
            and _tls_includes() in _PLAIN_TLS_INCLUDES
            and not _function_mode()
            and not _profiling()
            and _jit_tracing() is None
            and not (self._autocast and _autocast_enabled())
        )

    def allowed(self, args: tuple) -> bool:
        """Whether a call with these positional arguments (and no keywords) may go direct."""
        if not self._required <= len(args) <= self._count or not self.plain():
            return False
        grad = _grad_enabled()
        for position, value in enumerate(args):
            if position not in self._tensor_positions:
                if isinstance(value, torch.Tensor):
                    return False
            elif value is not None and not (
                type(value) in _PLAIN_TENSOR_TYPES
                and (value.is_cpu or value.is_cuda)
                and not (grad and value.requires_grad)
            ):
                return False
        return True

    def key(self, args: tuple) -> tuple | None:
        """What a cached direct call depends on (see the module docstring); None when the
        arguments cannot key one (too few or too many, a non-tensor where a tensor goes)."""
        try:
            return self._keys[len(args)](args)
        except (IndexError, TypeError, AttributeError):  # TypeError: no key function
            return None

    def order_changed(self) -> None:
        """An implementation order changed: calls bound under the old one are stale."""
        self._entries.clear()

    def find(self, args: tuple) -> DirectCall | None:
        """The cached direct call for these positional arguments if the context is plain: a
        repeat call's whole check, in one frame (``plain`` and ``key`` inlined)."""
        if not (
            self.enabled
            and _tls_includes() in _PLAIN_TLS_INCLUDES
            and not _function_mode()
            and not _profiling()
            and _jit_tracing() is None
            and not (self._autocast and _autocast_enabled())
        ):
            return None
        try:
            return self._entries.get(self._keys[len(args)](args))
        except (IndexError, TypeError, AttributeError):  # no key, or an unhashable argument
            return None

    def remember(self, args: tuple, call: DirectCall) -> None:
        """Keep ``call`` for later calls with arguments like ``args`` (which ``allowed``)."""
        key = self.key(args)
        if key is not None:
            with contextlib.suppress(TypeError):  # an unhashable argument: not cached
                self._entries[key] = call
