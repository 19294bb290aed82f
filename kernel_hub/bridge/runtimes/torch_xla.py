"""PyTorch/XLA tensors (device ``"xla"``): the kernel's TPU program joins torch_xla's lazy graph.

The op's JAX function is lowered for the TPU generation torch_xla runs on (``tpu_program``, once
per shape); the lowered HLO, the Pallas kernels' Mosaic custom calls inside it, is applied to the
input tensors as a torch_xla user computation. torch_xla compiles it together with the rest of its
graph, in lazy mode and under ``torch.compile(backend="openxla")`` alike, so XLA sees the kernels.
Nothing is copied to the host. (torch_xla's own ``call_jax`` works the same way but lowers for
whatever JAX's default device is and needs torchax installed.)
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import torch_xla.core.xla_builder as xla_builder
import torch_xla.core.xla_model as xla_model

from .dlpack import tensor_leaves
from .tpu_program import TpuProgram, program_for, tensor_signature


@functools.cache
def _device_name(device: str) -> str:
    """The TPU behind an XLA device, as PJRT names it ('TPU v5 lite')."""
    return xla_model.xla_device_kind(device)


def program_name(key: Any) -> str:
    """A readable computation name for an op call key ``(qualname, role, static)``."""
    qualname, role = key[0], key[1]
    return re.sub(r"\W", "_", f"{qualname}_{role}")


@functools.cache
def _computation(program: TpuProgram) -> Callable[[list[Any]], list[Any]]:
    computation = xla_builder.computation_from_module_proto(program.name, program.hlo_module)
    return xla_builder.xla_computation_as_func(computation, program.name)


class TorchXlaRuntime:
    """Applies the op's TPU program to XLA tensors inside torch_xla's graph."""

    def check_device(self, device: Any) -> None:
        """Nothing to check: torch_xla is loaded (an "xla" tensor exists) and runs the program."""

    def call(self, jax_fn: Callable[..., Any], tensors: Sequence[Any], *, key: Any) -> Any:
        inputs = tensor_leaves(tensors)
        program = program_for(
            jax_fn,
            tensor_signature(list(tensors)),
            _device_name(str(inputs[0].device)),
            program_name(key),
        )
        results = _computation(program)(inputs)
        return jax.tree.unflatten(program.out_tree, list(results))


RUNTIME = TorchXlaRuntime()
