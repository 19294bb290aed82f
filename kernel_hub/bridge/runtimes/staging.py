"""Reused input buffers for small CPU tensors, so a bridged call skips per-call DLPack imports.

Importing a tensor through DLPack makes a new JAX array on every call (~6 us), and XLA's CPU
client spends another ~10-15 us the first time an executable runs on an array it has not seen.
A decode step's activations are a few KiB, so for them that is most of a bridged call. Copying
such a tensor into a buffer JAX already holds costs ~1-2 us instead: a bound call keeps, per small
input, one torch tensor that shares memory with one JAX array, copies the argument into it and
passes the array. Parameters are not staged (``parameter_arrays.py`` already reuses their arrays)
and neither are inputs over ``MAX_STAGED_BYTES``, where the copy would cost more than the import.

Safety: the buffers belong to one bound call and are used under its lock, held until the outputs
are torch tensors. Staging is used only while JAX runs CPU computations synchronously (kernel-hub's
default thread policy), so the computation has finished reading the buffers when the lock is
released. A call that finds the lock taken (another thread, re-entry) imports as usual. XLA
outputs are fresh buffers; if the first staged call's output is a staged input (an executable
that forwards its argument), staging turns itself off.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

MAX_STAGED_BYTES = 64 * 1024


def shares_memory(array: Any, tensor: Any) -> bool:
    """Whether a JAX array imported from ``tensor`` is zero-copy (JAX copies misaligned memory).

    The import's copy may still be running on a JAX worker thread that needs the GIL to release
    the tensor; ``unsafe_buffer_pointer`` waits for the copy while holding the GIL, so wait first
    with ``block_until_ready``, which lets go of it.
    """
    array.block_until_ready()
    return array.unsafe_buffer_pointer() == tensor.data_ptr()


def synchronous_cpu_dispatch() -> bool:
    """Whether JAX runs CPU computations on the calling thread (see ``threads.py``)."""
    import jax

    return not jax.config.read("jax_cpu_enable_async_dispatch")


class InputStaging:
    """Staging buffers for the small, non-parameter tensors of one bound call signature."""

    def __init__(self, tensors: Sequence[Any], import_array: Callable[[Any], Any]):
        """``import_array``: the runtime's tensor (or None) -> JAX array, for unstaged inputs."""
        import torch

        self._lock = threading.Lock()
        self._import_array = import_array
        # per position: (torch buffer, JAX array sharing its memory), or None when not staged
        self._slots: list[tuple[Any, Any] | None] = []
        for tensor in tensors:
            slot = None
            if (
                tensor is not None
                and type(tensor) is not torch.nn.Parameter
                and tensor.numel() * tensor.element_size() <= MAX_STAGED_BYTES
            ):
                # a normal tensor even when the first call runs under torch.inference_mode():
                # an inference tensor could not be copied into by later calls outside it
                with torch.inference_mode(False):
                    buffer = torch.empty(tensor.shape, dtype=tensor.dtype)
                array = import_array(buffer)
                if shares_memory(array, buffer):
                    slot = (buffer, array)
            self._slots.append(slot)
        self._pointers = {slot[0].data_ptr() for slot in self._slots if slot is not None}
        self.enabled = bool(self._pointers)

    @property
    def staged_positions(self) -> list[int]:
        return [i for i, slot in enumerate(self._slots) if slot is not None]

    def bind(
        self,
        executable: Callable[..., Any],
        export: Callable[[Any], Any],
        fallback: Callable[[Sequence[Any]], Any],
    ) -> Callable[[Sequence[Any]], Any]:
        """``run(tensors)``: ``export(executable(*arrays))``, staged tensors copied into their
        buffers and the others imported; ``fallback(tensors)`` when staging is off or its buffers
        are in use (the fallback imports every tensor). ``tensors`` may run on past the staged
        call's tensors (an op's whole argument tuple): the rest is ignored."""
        lock, pointers, import_array = self._lock, self._pointers, self._import_array
        # the staged arrays in their places; the other places are filled per call
        template = [None if slot is None else slot[1] for slot in self._slots]
        copies = [(i, slot[0]) for i, slot in enumerate(self._slots) if slot is not None]
        imports = [i for i, slot in enumerate(self._slots) if slot is None]
        checked = False  # whether outputs were checked for sharing a staged buffer

        def run(tensors: Sequence[Any]) -> Any:
            nonlocal checked
            if not self.enabled or not lock.acquire(False):
                return fallback(tensors)
            try:
                for i, buffer in copies:
                    buffer.copy_(tensors[i])
                arrays = template
                if imports:
                    arrays = template.copy()
                    for i in imports:
                        arrays[i] = import_array(tensors[i])
                # export waits for the outputs with the GIL released (JAX workers may need it
                # to finish a copying import), so the buffers are free again once it returns
                outputs = export(executable(*arrays))
            finally:
                lock.release()
            if not checked:
                # An executable hands back an input buffer on every call or on none (the staged
                # arrays are the same each call), so the first call tells.
                checked = True
                leaves = outputs if type(outputs) in (tuple, list) else (outputs,)
                if any(leaf.data_ptr() in pointers for leaf in leaves):
                    self.enabled = False  # import instead, from now on
                    return fallback(tensors)
            return outputs

        return run
