"""Zero-copy torch <-> JAX array exchange through DLPack, with a fast path for CPU tensors.

The public ``jax.dlpack.from_dlpack`` costs ~30 us per array on CPU (device lookup, a stream
query, a dtype-canonicalising ``jnp.asarray``); jaxlib's own ``dlpack_managed_tensor_to_buffer``
does the same import in ~4 us, and exporting a capsule directly saves ~5 us per output. Those are
jaxlib internals, so the fast path is used only when their signature is one we know and a round
trip through it passes a self-test; otherwise (and for CUDA tensors, whose stream handshake the
public functions do) the public functions are used. ``KERNEL_HUB_DLPACK=public`` forces them.

Both paths share memory with the source tensor when its layout allows; a storage offset that is
not 64-byte aligned makes JAX copy. Callers pass contiguous tensors.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any, NamedTuple

from .parameter_arrays import reuse_parameter_arrays

log = logging.getLogger(__name__)

_DL_CPU = 1  # DLDeviceType.kDLCPU
# jaxlib extension versions whose ``dlpack_managed_tensor_to_buffer`` signature is known here:
# (capsule, device, stream, copy) from 300, plus a trailing dl_device_type from 467.
_MIN_EXTENSION = 300
_DEVICE_TYPE_ARG_EXTENSION = 467
_X64_TORCH_DTYPES = ("float64", "int64", "uint64", "complex128")


class Exchange(NamedTuple):
    """How tensors of one device become JAX arrays and back; ``name`` is 'internal' or 'public'."""

    to_jax: Callable[[Any], Any]
    to_torch: Callable[[Any], Any]
    name: str


def exchange_for(device_type: str, jax_device: Any) -> Exchange:
    """The fastest exchange that works for ``device_type`` tensors on ``jax_device``."""
    if device_type == "cpu" and os.environ.get("KERNEL_HUB_DLPACK", "") != "public":
        fast = _internal_cpu(jax_device)
        if fast is not None:
            return fast
    return public_exchange()


def public_exchange() -> Exchange:
    """``jax.dlpack.from_dlpack`` / ``torch.from_dlpack``; 64-bit dtypes kept via scoped x64."""
    import jax
    import torch

    def to_jax(tensor: Any) -> Any:
        tensor = tensor.detach()
        if str(tensor.dtype).removeprefix("torch.") in _X64_TORCH_DTYPES:
            with jax.enable_x64(True):  # otherwise JAX canonicalises f64 -> f32 (a copy)
                return jax.dlpack.from_dlpack(tensor)
        return jax.dlpack.from_dlpack(tensor)

    return Exchange(to_jax, torch.from_dlpack, "public")


def _internal_cpu(jax_device: Any) -> Exchange | None:
    try:
        import torch
        from jax._src.lib import _jax, jaxlib_extension_version
        from torch.utils.dlpack import from_dlpack, to_dlpack

        import_buffer = _jax.dlpack_managed_tensor_to_buffer
        export_buffer = _jax.buffer_to_dlpack_managed_tensor
    except (ImportError, AttributeError) as exc:
        log.debug("internal DLPack path unavailable: %s", exc)
        return None
    if jaxlib_extension_version < _MIN_EXTENSION:
        return None
    if jaxlib_extension_version >= _DEVICE_TYPE_ARG_EXTENSION:

        def to_jax(tensor: Any) -> Any:
            return import_buffer(to_dlpack(tensor), jax_device, None, None, _DL_CPU)

    else:

        def to_jax(tensor: Any) -> Any:
            return import_buffer(to_dlpack(tensor), jax_device, None, None)

    # torch.utils.dlpack.from_dlpack only forwards a capsule to this; call it directly.
    from_capsule = getattr(torch._C, "_from_dlpack", from_dlpack)

    def to_torch(array: Any) -> Any:
        return from_capsule(export_buffer(array, stream=None))

    exchange = Exchange(to_jax, to_torch, "internal")
    problem = _self_test(exchange)
    if problem is not None:
        log.warning("kernel-hub: internal DLPack path disabled (%s); using jax.dlpack", problem)
        return None
    return exchange._replace(to_jax=reuse_parameter_arrays(to_jax))


def _self_test(exchange: Exchange) -> str | None:
    """Why a torch -> JAX -> torch round trip is wrong (values, dtype, aliasing), or None."""
    import numpy as np
    import torch

    source = torch.arange(6, dtype=torch.float64).reshape(2, 3)
    try:
        array = exchange.to_jax(source)
        back = exchange.to_torch(array)
    except Exception as exc:  # any failure means: do not use this path
        return f"{type(exc).__name__}: {exc}"
    if array.shape != (2, 3) or str(array.dtype) != "float64":
        return f"imported as {array.dtype}{array.shape}, expected float64(2, 3)"
    if not np.array_equal(np.asarray(array), source.numpy()):
        return "imported values differ"
    if back.data_ptr() != source.data_ptr() or back.dtype != source.dtype:
        return "round trip did not share memory"
    return None
