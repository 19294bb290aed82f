"""PyTorch/XLA path: every kernel op's TPU lowering, its Mosaic payloads, the cache, the hand-off.

torch_xla cannot be installed beside torch 2.13 (each torch_xla release pins its own torch), so
``torch_xla`` is replaced by a stand-in that checks and records what the runtime hands it (an HLO
module and the input tensors) and answers with zero tensors shaped like the HLO's results; torch's
lazy device stands in for the XLA device. The lowering for TPU and the payload extraction are real:
they run the kernels' Pallas code through the Mosaic lowering, as on a TPU host.
"""

from __future__ import annotations

import re
import sys
import types
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from jax._src.lib import xla_client
from runtime_helpers import (
    LAZY,
    OpCase,
    fake_outputs,
    inputs_on,
    lazy_device,
    op_cases,
    run_forward_and_backward,
    torch_dtype,
    zeros,
)

from kernel_hub import get_kernel
from kernel_hub.bridge import runtimes
from kernel_hub.bridge.runtimes import tpu_program
from kernel_hub.bridge.runtimes.dlpack import tensor_leaves
from kernel_hub.bridge.runtimes.tpu_program import program_for, tensor_signature

DEVICE_KIND = "TPU v5 lite"


class StandInTorchXla:
    """The two torch_xla functions the runtime uses, checking their inputs; records every call."""

    def __init__(self) -> None:
        self.runs: list[tuple[str, bytes]] = []

    def modules(self) -> dict[str, types.ModuleType]:
        names = ("torch_xla", "torch_xla.core", "torch_xla.core.xla_builder")
        modules = {name: types.ModuleType(name) for name in (*names, "torch_xla.core.xla_model")}
        modules["torch_xla.core.xla_builder"].computation_from_module_proto = self.computation
        modules["torch_xla.core.xla_builder"].xla_computation_as_func = self.as_func
        modules["torch_xla.core.xla_model"].xla_device_kind = lambda device: DEVICE_KIND
        return modules

    def computation(self, name: str, proto: bytes) -> tuple[str, bytes]:
        return name, proto

    def as_func(self, computation: tuple[str, bytes], name: str):
        def run(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
            shape = xla_client.XlaComputation(computation[1]).program_shape()
            params = [
                (tuple(p.dimensions()), p.numpy_dtype().name) for p in shape.parameter_shapes()
            ]
            given = [(tuple(t.shape), str(t.dtype).removeprefix("torch.")) for t in inputs]
            assert given == params, f"{name}: inputs {given} but the program takes {params}"
            self.runs.append(computation)
            result = shape.result_shape()
            results = result.tuple_shapes() if result.is_tuple() else [result]
            return [zeros(r.dimensions(), torch_dtype(r.numpy_dtype()), LAZY) for r in results]

        return run


@dataclass
class Call:
    jax_fn: Any
    signature: Any
    key: Any


class RecordingRuntime:
    """Wraps the real torch_xla runtime and remembers each call's function, shapes and key."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: list[Call] = []

    def check_device(self, device: Any) -> None:
        self.inner.check_device(device)

    def call(self, jax_fn, tensors, *, key):
        self.calls.append(Call(jax_fn, tensor_signature(list(tensors)), key))
        return self.inner.call(jax_fn, tensors, key=key)


@pytest.fixture
def xla(monkeypatch):
    """The torch_xla runtime, imported against the stand-in, serving the lazy device."""
    lazy_device()
    stand_in = StandInTorchXla()
    for name, module in stand_in.modules().items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.delitem(sys.modules, "kernel_hub.bridge.runtimes.torch_xla", raising=False)
    from kernel_hub.bridge.runtimes import torch_xla as xla_runtime

    recording = types.ModuleType("recording_xla_runtime")
    recording.RUNTIME = RecordingRuntime(xla_runtime.RUNTIME)
    monkeypatch.setitem(sys.modules, recording.__name__, recording)
    monkeypatch.setitem(runtimes._RUNTIME_MODULES, LAZY, recording.__name__)
    yield types.SimpleNamespace(
        stand_in=stand_in, calls=recording.RUNTIME.calls, module=xla_runtime
    )
    # Built against the stand-in: a later import must see the real torch_xla (or none).
    sys.modules.pop("kernel_hub.bridge.runtimes.torch_xla", None)
    if hasattr(runtimes, "torch_xla"):
        delattr(runtimes, "torch_xla")


def _hlo_text(hlo_module: bytes) -> str:
    return xla_client.XlaComputation(hlo_module).as_hlo_text()


@pytest.mark.parametrize("op_case", op_cases(), ids=lambda c: c.id)
def test_every_kernel_op_reaches_torch_xla_as_mosaic_calls(op_case: OpCase, xla):
    outputs, grads = run_forward_and_backward(op_case, inputs_on(lazy_device(), op_case))

    roles = [call.key[1] for call in xla.calls]
    assert roles == (["forward", "backward"] if op_case.case.differentiable else ["forward"])
    assert len(xla.stand_in.runs) == len(xla.calls)
    for call, (_, handed_over) in zip(xla.calls, xla.stand_in.runs, strict=True):
        hits = program_for.cache_info().hits
        program = program_for(
            call.jax_fn, call.signature, DEVICE_KIND, xla.module.program_name(call.key)
        )
        assert program_for.cache_info().hits == hits + 1, "the runtime's lowering was not cached"
        assert program.hlo_module == handed_over
        assert program.kernels, f"{call.key[1]}: no Pallas kernel in the TPU lowering"
        for kernel in program.kernels:
            assert kernel.name and kernel.mosaic_bytecode()
        in_hlo = re.findall(r'custom_call_target="tpu_custom_call"', _hlo_text(handed_over))
        # every Mosaic call reaching HLO came from the lowering; HLO drops one whose result is
        # unused (backwards that lower a forward kernel they do not use: gated-mlp's, and the
        # XLA backwards of gated-delta-rule, causal-conv1d and gated_rms_norm; noted as waste)
        assert len(in_hlo) <= len(program.kernels)
        assert in_hlo or call.key[1] == "backward", "the forward reached XLA without its kernel"

    got = [(tuple(t.shape), t.dtype) for t in tensor_leaves(outputs)]
    assert got == fake_outputs(op_case)
    if grads is not None:
        wanted = [op_case.case.args[i] for i in op_case.case.differentiable]
        assert [tuple(g.shape) for g in grads] == [tuple(s.shape) for s in wanted]


def test_backward_payloads_hold_the_forward_and_backward_kernels(xla):
    k = get_kernel("rmsnorm")
    x = torch.zeros(16, 256, device=lazy_device(), requires_grad=True)
    w = torch.zeros(256, device=lazy_device(), requires_grad=True)
    k.rms_norm(x, w, 1e-6).sum().backward()

    names = [
        [kernel.name for kernel in program_for(c.jax_fn, c.signature, DEVICE_KIND, "").kernels]
        for c in xla.calls
    ]
    assert names == [["rms_norm_forward"], ["rms_norm_forward", "rms_norm_backward"]]


def test_lowering_is_cached_per_shape(xla):
    k = get_kernel("rmsnorm")
    w = torch.zeros(384, device=lazy_device())
    before = program_for.cache_info()
    k.rms_norm(torch.zeros(24, 384, device=lazy_device()), w)
    k.rms_norm(torch.zeros(24, 384, device=lazy_device()), w)
    middle = program_for.cache_info()
    k.rms_norm(torch.zeros(40, 384, device=lazy_device()), w)
    after = program_for.cache_info()

    assert (middle.misses - before.misses, middle.hits - before.hits) == (1, 1)
    assert after.misses - middle.misses == 1
    assert len(xla.stand_in.runs) == 3


def test_payload_extraction_rejects_a_body_that_is_not_mosaic():
    bad = tpu_program.MosaicKernel("k", '{"custom_call_config": {"body": "aGVsbG8="}}')
    with pytest.raises(ValueError, match="not MLIR bytecode"):
        bad.mosaic_bytecode()
