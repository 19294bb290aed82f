"""When a bridged op may skip torch's dispatcher and call its implementation directly.

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
call. The caller checks first
that torch.compile is not tracing. Anything else goes through the dispatcher as usual.
``KERNEL_HUB_DIRECT_CALLS=0`` sends every call through the dispatcher.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Sequence

import torch

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


class DirectCalls:
    """Decides, per call of one op, whether it may call its implementation directly."""

    def __init__(
        self, signature: inspect.Signature, tensor_params: Sequence[str], autocast: bool = False
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
        self.enabled = os.environ.get("KERNEL_HUB_DIRECT_CALLS", "1").strip() != "0"

    def positional(self, args: tuple, kwargs: dict) -> tuple | None:
        """Every argument in parameter order (defaults filled in), or None when the keywords do
        not bind (unknown, given twice, a required one missing): the dispatcher then says why."""
        n = len(args)
        if (
            n > self._count
            or not kwargs.keys() <= self._tail_names[n]
            or not self._tail_required[n] <= kwargs.keys()
        ):
            return None
        return args + tuple([kwargs.get(name, default) for name, default in self._tails[n]])

    def allowed(self, args: tuple) -> bool:
        """Whether a call with these positional arguments (and no keywords) may go direct."""
        if (
            not self.enabled
            or not self._required <= len(args) <= self._count
            or _tls_includes() not in _PLAIN_TLS_INCLUDES
            or _function_mode()
            or _profiling()
            or _jit_tracing() is not None
            or (self._autocast and _autocast_enabled())
        ):
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
