"""The TorchTPU stand-in runtime shared by the TorchTPU tests (see test_torch_tpu_runtime.py).

TorchTPU creates its "tpu" device only on a TPU host, so tensors go to torch's lazy device and
this runtime takes the "tpu" runtime's place for it: each call builds its TorchTPU op with the
real runtime code (``torch.tpu.pallas.jax_op``), runs TorchTPU's fake implementation on meta
copies of the inputs, and answers with zeros of those shapes on the lazy device.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import jax
import pytest
import torch
from runtime_helpers import LAZY, lazy_device

from kernel_hub.bridge import runtimes
from kernel_hub.bridge.runtimes import torch_tpu as tpu_runtime
from kernel_hub.bridge.runtimes.dlpack import tensor_leaves

DEVICE = "TPU v6e"  # as torch.tpu.get_device_name() names it


@dataclass
class Wrapped:
    key: Any
    jax_fn: Any
    tensors: Any
    tpu_op: tpu_runtime.TpuOp
    fake: list[tuple[tuple[int, ...], torch.dtype]]


def _to_meta(tree: Any) -> Any:
    if isinstance(tree, (list, tuple)):
        return [_to_meta(item) for item in tree]
    return None if tree is None else torch.empty(tree.shape, dtype=tree.dtype, device="meta")


class WrappingRuntime(tpu_runtime.TorchTpuRuntime):
    """TorchTPU's wrapping and fake shapes for each call; zeros on the stand-in device."""

    def __init__(self) -> None:
        self.wrapped: list[Wrapped] = []

    def call(self, jax_fn, tensors, *, key):
        tpu_op = tpu_runtime.op_for(jax_fn, tensors, key, DEVICE)
        fake = tpu_op(*_to_meta(list(tensors)))
        shapes = [(tuple(t.shape), t.dtype) for t in tensor_leaves(fake)]
        self.wrapped.append(Wrapped(key, jax_fn, list(tensors), tpu_op, shapes))
        return jax.tree.map(
            lambda t: torch.zeros(t.shape, dtype=t.dtype, device=LAZY),
            fake,
            is_leaf=lambda t: isinstance(t, torch.Tensor),
        )


def install_wrapping_runtime(monkeypatch: pytest.MonkeyPatch) -> WrappingRuntime:
    """Route the lazy (stand-in) device's tensors to a fresh ``WrappingRuntime``."""
    lazy_device()
    runtime = WrappingRuntime()
    module = type(tpu_runtime)("wrapping_tpu_runtime")
    module.RUNTIME = runtime
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(runtimes._RUNTIME_MODULES, LAZY, module.__name__)
    return runtime
