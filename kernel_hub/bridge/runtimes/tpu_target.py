"""Tracing kernels for a TPU that JAX does not own.

TorchTPU and PyTorch/XLA hold the TPU themselves; JAX in their process may see only the CPU. A
kernel's implementation table and its Pallas calls ask JAX's default device which platform and TPU
generation they are traced for (``kernel_hub.platform``). Inside ``tracing_for_tpu`` that device is
a TPU of the runtime's generation (deviceless through libtpu, or abstract without it): the Pallas
TPU implementation is chosen and lowered to Mosaic (never CPU interpret mode), and no TPU chip is
claimed by JAX.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
from collections.abc import Iterator
from typing import Any

from kernel_hub.platform import tpu_generation_of_kind
from kernel_hub.topologies import TOPOLOGIES, tpu_device

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
    """A JAX device standing for the TPU ``name``: deviceless via libtpu, else abstract.

    A deviceless libtpu device serves tracing and lowering (Mosaic asks which chip it lowers for,
    e.g. for integer division). Without libtpu, ``jax.sharding.AbstractDevice`` serves tracing, and
    kernels whose lowering needs the chip's details fail with JAX's message.
    """
    import jax

    kind = jax_device_kind(name)
    generation = tpu_generation_of_kind(kind)
    has_abstract = "platform" in inspect.signature(jax.sharding.AbstractDevice).parameters
    if generation in TOPOLOGIES and (importlib.util.find_spec("libtpu") or not has_abstract):
        return tpu_device(generation)
    return jax.sharding.AbstractDevice(kind, 1, "tpu")


@contextlib.contextmanager
def tracing_for_tpu(name: str) -> Iterator[None]:
    """Trace JAX code as if for the TPU ``name``; lower the result with ``lowering_platforms``.

    Tracing and lowering happen inside; arrays cannot be placed on the target.
    """
    import jax

    with jax.default_device(tpu_target(name)):
        yield
