"""torchax tensors (device ``"jax"``): torch tensors that wrap JAX arrays, on any JAX device.

torchax decides what an op does inside its tensor classes, before the op's own kernel is reached,
so every kernel-hub op is registered with them (``register``): the rule runs the op's ordinary
implementation, whose runtime call (``TorchaxRuntime.call``) hands the wrapped JAX arrays straight
to the jitted JAX function and wraps the results: no copy, no host round trip.

The op's autograd formula sits above the rule, so ``loss.backward()`` on "jax" tensors runs the
kernel's backward op the same way. Inside torchax's jit (``torchax.interop.jax_jit``,
``JittableModule``) the arrays are tracers and the JAX function is traced into the one program,
where JAX autodiff goes through the kernel's ``custom_vjp``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import torch
import torchax.tensor
import torchax.view

from .dlpack import tensor_leaves

TORCHAX_TENSOR_TYPES = (torchax.tensor.Tensor, torchax.view.View)


def _arrays(tree: Any) -> Any:
    """The JAX arrays inside torchax tensors and views (a view's is computed on its device)."""
    if isinstance(tree, (list, tuple)):
        return type(tree)(_arrays(item) for item in tree)
    return None if tree is None else tree.jax()


class TorchaxRuntime:
    """Runs the JAX function on the arrays inside torchax tensors; results are torchax tensors."""

    def check_device(self, device: Any) -> None:
        """Nothing to check: a "jax" tensor's array already lives on a device JAX runs on."""

    def call(self, jax_fn: Callable[..., Any], tensors: Sequence[Any], *, key: Any = None) -> Any:
        env = tensor_leaves(tensors)[0]._env
        outputs = jax_fn(*_arrays(list(tensors)))
        return jax.tree.map(lambda array: torchax.tensor.Tensor(array, env), outputs)

    def dispatch(self, implementation: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        """What torchax's tensor classes do for a kernel-hub op: run the op's implementation."""
        return implementation(*args, **(kwargs or {}))


RUNTIME = TorchaxRuntime()


def register(op: Any) -> None:
    """Make torchax tensors run ``op`` (a kernel-hub ``JaxOp``) and its backward op."""
    for overload, implementation in (
        (op.op, op.implementation),
        (op.backward_op, op.backward_implementation),
    ):
        if overload is None:
            continue

        def rule(_cls, _func, _types, args, kwargs, implementation=implementation):
            return RUNTIME.dispatch(implementation, args, kwargs)

        for tensor_type in TORCHAX_TENSOR_TYPES:
            torch.library.register_torch_dispatch(overload, tensor_type, rule)
