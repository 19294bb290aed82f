"""Autocast for bridged ops: inside ``torch.autocast`` an op casts the inputs its spec names.

torch's autocast casts the inputs of the ops on its lists (``scaled_dot_product_attention`` is on
the lower-precision list of CPU and CUDA) and never touches a custom op. So that a kernel op runs
in the dtype the stock layer would, ``jax_op(..., autocast=("query", "key", "value"))`` registers
an Autocast kernel that casts those floating tensor arguments to the region's dtype
(``torch.get_autocast_dtype``) and redispatches with autocast off; the other arguments (masks,
sinks, biases) keep their dtypes. An op with no names there runs in its inputs' dtypes, which is
what autocast does with Transformers' norms (their arithmetic is upcast to f32 by hand).

Registered for the ``cpu`` and ``cuda`` autocast keys. TPU runtimes: torch_xla has its own
``AutocastXLA`` key and TorchTPU (PrivateUse1) ``AutocastPrivateUse1``; neither is registered
here (nothing to test them on), so under their autocast an op runs in its inputs' dtypes and
attention asks for one dtype. torchax runs ops as JAX functions and applies no torch autocast.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

DEVICE_TYPES = ("cpu", "cuda")


def is_enabled() -> bool:
    """Whether any autocast region is active (cheap; checked on the eager fast path)."""
    return torch._C._is_any_autocast_enabled()


def _cast(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype:
        return value.to(dtype)
    return value


def register(library: Any, op: Any, positions: Sequence[int]) -> None:
    """Autocast kernels of ``op`` (an ``OpOverload``) casting the arguments at ``positions``."""
    cast = frozenset(positions)
    op_name = op.name().split("::")[1]
    for device_type in DEVICE_TYPES:
        key_name = "Autocast" + torch._C._dispatch_key_for_device(device_type)
        key = getattr(torch._C.DispatchKey, key_name)

        def autocast_call(*args: Any, _device_type: str = device_type, _key: Any = key) -> Any:
            dtype = torch.get_autocast_dtype(_device_type)
            with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(_key)):
                return op(*[_cast(a, dtype) if i in cast else a for i, a in enumerate(args)])

        # The Python kernel serves torch.compile's tracing (Python dispatcher), the library one
        # eager calls; torch.library.register_autocast does the same.
        op.py_impl(key)(autocast_call)
        library.impl(op_name, autocast_call, key_name)
