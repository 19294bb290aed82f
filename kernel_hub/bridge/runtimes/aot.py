"""Ahead-of-time compilation of a bridged JAX function for one device and input signature.

Runtimes compile once per (op key, device, shapes, dtypes) and then call the executable directly:
no jit dispatch and no ``jax.default_device`` or x64 context per call. The device and 64-bit
types matter only while tracing (implementation tables ask which platform they trace for), so
that is the only place they are set. Compiles go through kernel-hub's persistent compilation
cache.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kernel_hub.bridge import compile_cache
from kernel_hub.bridge.tensors import map_tensors, needs_x64, torch_to_jax_dtype, x64_scope

_compiled = 0


def compilations() -> int:
    """Executables the bridge compiled in this process (persistent-cache hits included: they
    skip XLA but are still traced and lowered)."""
    return _compiled


def compile_for(jax_fn: Callable[..., Any], tensors: Any, device: Any) -> Any:
    """``jax_fn`` (jitted) compiled for the shapes and dtypes of ``tensors`` (nested lists of
    tensors and Nones) on the JAX ``device``; call it with JAX arrays nested the same way."""
    import jax
    from jax.sharding import SingleDeviceSharding

    global _compiled
    sharding = SingleDeviceSharding(device)

    def struct(tensor: Any) -> Any:
        dtype = torch_to_jax_dtype(tensor.dtype)
        return jax.ShapeDtypeStruct(tuple(tensor.shape), dtype, sharding=sharding)

    with x64_scope(needs_x64(tensors)):
        structs = map_tensors(struct, tensors)
        with jax.default_device(device), compile_cache.persistent_cache():
            compiled = jax_fn.trace(*structs).lower().compile()
    _compiled += 1
    return compiled


def fast_call(compiled: Any) -> Callable[..., Any]:
    """What to call a ``jax.stages.Compiled`` through: the C++ dispatcher that
    ``Compiled.__call__`` makes on its first call and then forwards every call to from Python
    (~0.4 us a call), made here up front; the ``Compiled`` itself when JAX makes none (effects,
    host callbacks) or its internals differ from those known here."""
    try:
        call = compiled._executable.create_cpp_call(compiled._params)
    except (AttributeError, TypeError):
        return compiled
    return compiled if call is None or not callable(call) else call
