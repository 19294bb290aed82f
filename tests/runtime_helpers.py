"""Shared pieces of the TPU-runtime tests: a stand-in device and every in-tree kernel's op cases.

No TPU runtime's device exists on a CPU host, so these tests send real kernel-hub ops to torch's
lazy-tensor device (TorchScript backend) and map that device type to the runtime under test. Its
tensors hold no data until read, so the kernels' full benchmark shapes cost nothing.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any

import jax
import torch

from kernel_hub import get_kernel, load_registry
from kernel_hub.bench.cases import KernelCase
from kernel_hub.bridge.runtimes.dlpack import tensor_leaves
from kernel_hub.bridge.torch_op import JaxOp

LAZY = "lazy"


@functools.cache
def lazy_device() -> torch.device:
    """Start torch's lazy-tensor backend once per process."""
    import torch._lazy.ts_backend

    torch._lazy.ts_backend.init()
    return torch.device(LAZY)


@dataclass(frozen=True)
class OpCase:
    """One benchmark case of one kernel, with the torch op that runs it."""

    kernel: str
    case: KernelCase
    op: JaxOp

    @property
    def id(self) -> str:
        return f"{self.kernel}-{self.case.name}"


def op_cases() -> list[OpCase]:
    """Every benchmark case of every kernel in the registry, each paired with its torch op."""
    cases, seen = [], set()
    for entry in load_registry():
        if entry.kernel in seen:
            continue
        seen.add(entry.kernel)
        module = get_kernel(entry.name)
        ops = [op for op in vars(module).values() if isinstance(op, JaxOp)]
        for case in module.KERNEL.benchmark_cases:
            # The op wrapping the case's function, else the op of that name (a thin JAX wrapper
            # can stand between a torch op and the kernel's public function).
            op = next((op for op in ops if op.jax_fn is case.fn), None)
            op = op or getattr(module, case.fn.__name__, None)
            if not isinstance(op, JaxOp):
                raise LookupError(
                    f"kernel {entry.kernel}: benchmark case {case.name} calls "
                    f"{case.fn.__name__}, which backs none of its torch ops"
                )
            cases.append(OpCase(entry.kernel, case, op))
    return cases


def torch_dtype(dtype: Any) -> torch.dtype:
    return getattr(torch, jax.numpy.dtype(dtype).name)


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Zeros that stay a lazy node on the lazy device: it materializes ``torch.zeros`` (6.3 GB of
    host memory for GPT-OSS-120B's expert weights) but not ``torch.full``, whose fill value it
    cannot hash for 8-bit floats (zero bytes viewed as one are +0.0)."""
    if dtype.is_floating_point and dtype.itemsize == 1:
        return torch.full(shape, 0, dtype=torch.uint8, device=device).view(dtype)
    return torch.full(shape, 0, dtype=dtype, device=device)


def inputs_on(device: torch.device | str, op_case: OpCase) -> list[torch.Tensor | None]:
    """Zero tensors shaped like the case's arguments (an absent optional one stays None);
    differentiable ones require grad."""
    tensors = []
    for position, struct in enumerate(op_case.case.args):
        if struct is None:
            tensors.append(None)
            continue
        tensor = zeros(struct.shape, torch_dtype(struct.dtype), device)
        tensors.append(tensor.requires_grad_(position in op_case.case.differentiable))
    return tensors


def call_op(op_case: OpCase, inputs: list[torch.Tensor | None]) -> Any:
    """The op on the case's arguments: positionally while the torch schema's parameter names
    follow the JAX function's, by name from the first that does not (an op may take tensors
    after its options in torch, e.g. ragged attention's 8-bit KV scales)."""
    jax_names = list(inspect.signature(op_case.case.fn).parameters)
    torch_names = [argument.name for argument in op_case.op.op._schema.arguments]
    positional: list[torch.Tensor | None] = []
    named: dict[str, torch.Tensor] = {}
    for position, tensor in enumerate(inputs):
        if not named and torch_names[position : position + 1] == [jax_names[position]]:
            positional.append(tensor)
        elif tensor is not None:
            named[jax_names[position]] = tensor
    return op_case.op(*positional, **named, **op_case.case.kwargs)


def run_forward_and_backward(op_case: OpCase, inputs: list[torch.Tensor]) -> tuple[Any, Any]:
    """Call the op, then its backward for the case's differentiable arguments (if any)."""
    outputs = call_op(op_case, inputs)
    if not op_case.case.differentiable:
        return outputs, None
    leaves = tensor_leaves(outputs)
    grads = torch.autograd.grad(
        leaves,
        [inputs[i] for i in op_case.case.differentiable],
        grad_outputs=[torch.ones_like(leaf) for leaf in leaves],
    )
    return outputs, grads


def fake_outputs(op_case: OpCase) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of the op's outputs from its own fake implementation."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        outputs = call_op(op_case, inputs_on("cpu", op_case))
    return [(tuple(t.shape), t.dtype) for t in tensor_leaves(outputs)]
