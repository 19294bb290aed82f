"""Tracing kernels for a TPU that JAX does not own.

TorchTPU and PyTorch/XLA hold the TPU themselves; JAX in their process may see only the CPU. A
kernel's implementation table and its Pallas calls ask JAX's default device which platform and TPU
generation they are traced for (``kernel_hub.platform``). Inside ``tracing_for_tpu`` that device is
an abstract TPU of the runtime's generation: the Pallas TPU implementation is chosen and lowered to
Mosaic (never CPU interpret mode), and no TPU client is started in JAX.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator
from typing import Any

from ..platform import tpu_generation_of_kind

# Generation -> the device_kind JAX itself reports for it (what kernels and JAX's tables expect).
_JAX_DEVICE_KINDS: dict[str, str] = {
    "v4": "TPU v4",
    "v4i": "TPU v4 lite",
    "v5e": "TPU v5 lite",
    "v5p": "TPU v5",
    "v6e": "TPU v6 lite",
    "tpu7x": "TPU7x",
}


def jax_device_kind(name: str) -> str:
    """JAX's device_kind for a TPU as a runtime names it ('TPU v5e' -> 'TPU v5 lite').

    Names kernel-hub does not know (a newer TPU) are kept as they are.
    """
    return _JAX_DEVICE_KINDS.get(tpu_generation_of_kind(name), name)


@functools.cache
def tpu_target(name: str) -> Any:
    """A JAX device standing for the TPU ``name`` while tracing: abstract, or deviceless via libtpu.

    ``jax.sharding.AbstractDevice`` needs no libtpu; JAX releases whose AbstractDevice has no
    platform get the first device of a deviceless libtpu topology instead.
    """
    import jax

    kind = jax_device_kind(name)
    if "platform" in inspect.signature(jax.sharding.AbstractDevice).parameters:
        return jax.sharding.AbstractDevice(kind, 1, "tpu")
    from ..compile_check import tpu_device

    return tpu_device(tpu_generation_of_kind(kind))


@contextlib.contextmanager
def tracing_for_tpu(name: str) -> Iterator[None]:
    """Trace JAX code as if for the TPU ``name``; lower the result with ``lowering_platforms``.

    Only tracing may happen inside: JAX cannot place arrays or lower on an abstract device.
    """
    import jax

    with jax.default_device(tpu_target(name)):
        yield
