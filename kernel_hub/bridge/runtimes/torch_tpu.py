"""TorchTPU tensors (device ``"tpu"``): every op call runs through TorchTPU's own JAX-op mechanism.

For each op, role (forward/backward), static arguments and argument structure, the jitted JAX
function becomes a ``torch.tpu.pallas.jax_op``: a torch custom op whose schema comes from type
hints and whose fake implementation comes from ``jax.export`` for TPU. TorchTPU exports the
function for TPU and runs it as a custom kernel on its own device buffers, with no host copy.
``torch.compile(backend="tpu")`` builds its program by running each graph op on placeholder TPU
tensors, so the kernel is recorded into the compiled program rather than left as an opaque call.

JAX in a TorchTPU process may see only the CPU, so the function is traced for the TPU that
TorchTPU reports (``tracing_for_tpu``): kernels choose and lower their Pallas TPU implementation.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import re
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import torch

from kernel_hub.errors import UnsupportedDeviceError

from .tpu_program import abstract_arrays, tensor_signature
from .tpu_target import tracing_for_tpu

TPU_OP_NAMESPACE = "kernel_hub_tpu"


@dataclass(frozen=True)
class TpuOp:
    """A TorchTPU op standing for one kernel-hub op call shape."""

    custom_op: Any
    """The ``torch.tpu.pallas.jax_op`` (a torch custom op) that runs ``kernel``."""
    kernel: Callable[..., Any]
    """The JAX function handed to TorchTPU: the jitted op function, traced for TPU."""
    device: str
    """The TPU it is traced and lowered for, as TorchTPU names it."""
    one_tuple: bool = False
    """The op function returns a 1-tuple: TorchTPU's schema makes that one ``Tensor`` while its
    fake implementation keeps the tuple, so ``kernel`` returns the array and ``call`` re-wraps."""

    def __call__(self, *tensors: Any) -> Any:
        # TorchTPU exports (lowers) the kernel inside this call, and Mosaic asks which chip it
        # lowers for there too (e.g. for jnp.sign), not only while tracing
        with tracing_for_tpu(self.device):
            result = self.custom_op(*tensors)
        return (result,) if self.one_tuple else result


def _jax_op() -> Callable[..., Any]:
    """``torch.tpu.pallas.jax_op``, or a clear error naming what to install."""
    try:
        import torch_tpu  # noqa: F401  (attaches torch.tpu)
    except ImportError as exc:
        raise UnsupportedDeviceError(
            f"tensors on device 'tpu' need TorchTPU (pip install torch-tpu); importing it failed: "
            f"{exc}"
        ) from None
    jax_op = getattr(getattr(getattr(torch, "tpu", None), "pallas", None), "jax_op", None)
    if jax_op is None:
        raise UnsupportedDeviceError(
            "this TorchTPU has no torch.tpu.pallas.jax_op; kernel-hub needs torch-tpu>=0.2"
        )
    return jax_op


@functools.cache
def device_name() -> str:
    """The TPU TorchTPU runs on, e.g. 'TPU v6e'."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*experimental.*")
        return torch.tpu.get_device_name()


def _structure(tensors: Any) -> Any:
    """Which arguments are tensors, Nones or lists (and which list items are None)."""
    if isinstance(tensors, (list, tuple)):
        return tuple(_structure(item) for item in tensors)
    return None if tensors is None else "tensor"


def _parameter_annotation(structure: Any) -> Any:
    if structure is None:
        return jax.Array | None
    if isinstance(structure, tuple):
        return list[jax.Array | None] if None in structure else list[jax.Array]
    return jax.Array


def _return_annotation(outputs: Any) -> Any:
    if isinstance(outputs, tuple):
        return tuple[tuple(_return_annotation(item) for item in outputs)]
    if isinstance(outputs, list):
        return list[jax.Array]
    if isinstance(outputs, jax.ShapeDtypeStruct):
        return jax.Array
    raise TypeError(f"a kernel-hub op returned {type(outputs).__name__}; TorchTPU takes arrays")


def _op_name(key: Any, structure: Any, device: str) -> str:
    qualname, role, *specialisation = key  # static arguments, implementation-order generation
    digest = hashlib.sha256(repr((specialisation, structure, device)).encode()).hexdigest()[:12]
    return re.sub(r"\W", "_", f"{qualname}_{role}_{digest}")


_ops: dict[tuple[Any, ...], TpuOp] = {}


def op_for(jax_fn: Callable[..., Any], tensors: Sequence[Any], key: Any, device: str) -> TpuOp:
    """The TorchTPU op for one kernel-hub op call: made on first use, then reused.

    ``tensors`` are the call's tensor arguments (tensors, Nones, lists); any device, meta included,
    since only their shapes are read.
    """
    structure = _structure(list(tensors))
    cache_key = (jax_fn, key, structure, device)
    if cache_key not in _ops:
        _ops[cache_key] = _make_op(jax_fn, tensors, key, structure, device)
    return _ops[cache_key]


def _make_op(
    jax_fn: Callable[..., Any], tensors: Sequence[Any], key: Any, structure: Any, device: str
) -> TpuOp:
    with tracing_for_tpu(device):
        outputs = jax.eval_shape(jax_fn, *abstract_arrays(tensor_signature(list(tensors))))
    one_tuple = isinstance(outputs, tuple) and len(outputs) == 1
    outputs = outputs[0] if one_tuple else outputs

    def kernel(*arrays):
        with tracing_for_tpu(device):
            result = jax_fn(*arrays)
        return result[0] if one_tuple else result

    name = _op_name(key, structure, device)
    kernel.__name__ = kernel.__qualname__ = name
    kernel.__signature__ = inspect.Signature(
        [
            inspect.Parameter(f"arg{i}", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=a)
            for i, a in enumerate(_parameter_annotation(s) for s in structure)
        ],
        return_annotation=_return_annotation(outputs),
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*jax_op is experimental.*")
        custom_op = _jax_op()(f"{TPU_OP_NAMESPACE}::{name}", kernel)
    return TpuOp(custom_op, kernel, device, one_tuple)


class TorchTpuRuntime:
    """Runs each op call as its TorchTPU JAX op on the TPU tensors."""

    def check_device(self, device: Any) -> None:
        _jax_op()

    def call(self, jax_fn: Callable[..., Any], tensors: Sequence[Any], *, key: Any) -> Any:
        return op_for(jax_fn, tensors, key, device_name())(*tensors)


RUNTIME = TorchTpuRuntime()
