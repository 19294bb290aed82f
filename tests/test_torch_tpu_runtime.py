"""TorchTPU path: every kernel op call wraps through ``torch.tpu.pallas.jax_op``.

Runs where torch-tpu is installed: scripts/test.sh gives it its own venv, since torch-tpu loads
itself into every ``import torch`` and needs a newer libtpu than jax[tpu] pins. There is no TPU
here, and TorchTPU creates its "tpu" device only on a TPU host, so torch's lazy device stands in
for it: real kernel-hub ops (forward, then backward through autograd) reach a runtime that builds
each call's TorchTPU op with the real runtime code, runs TorchTPU's own fake implementation (a
``jax.export`` for TPU) on meta copies of the inputs, and answers with zeros of those shapes.

Not run here: TorchTPU's custom-kernel call on a TPU (``call_custom_kernel``) and
``torch.compile(backend="tpu")``; both need a TPU.
"""

from __future__ import annotations

import re

import jax
import pytest
import torch

pytest.importorskip("torch_tpu", reason="torch-tpu is tested in its own venv (scripts/test.sh)")

from runtime_helpers import (
    OpCase,
    fake_outputs,
    inputs_on,
    lazy_device,
    op_cases,
    run_forward_and_backward,
)
from torch_tpu_helpers import Wrapped, install_wrapping_runtime

from kernel_hub import get_kernel
from kernel_hub.bridge.runtimes import torch_tpu as tpu_runtime
from kernel_hub.bridge.runtimes.dlpack import tensor_leaves
from kernel_hub.bridge.runtimes.tpu_program import (
    abstract_arrays,
    mosaic_kernels_in_text,
    tensor_signature,
)
from kernel_hub.bridge.runtimes.tpu_target import tracing_for_tpu


@pytest.fixture
def wrapping(monkeypatch):
    return install_wrapping_runtime(monkeypatch)


def _schema(tpu_op: tpu_runtime.TpuOp) -> str:
    return str(tpu_op.custom_op._opoverload._schema)


def _exported_kernels(wrapped: Wrapped) -> list[str]:
    with tracing_for_tpu(wrapped.tpu_op.device):  # Mosaic asks for the chip while lowering
        exported = jax.export.export(
            jax.jit(wrapped.tpu_op.kernel),
            platforms=["tpu"],
            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("ALL")],
        )(*abstract_arrays(tensor_signature(wrapped.tensors)))
    return [kernel.name for kernel in mosaic_kernels_in_text(exported.mlir_module())]


INPUT_BYTES_LIMIT = 256 << 20
"""Cases whose inputs exceed this are not materialised on the stand-in device: model-size cases
(1-8 GiB of zeros each, twice over with outputs and gradients) OOM-killed this process on the
24 GiB CI machine. The wrapping does not depend on sizes; every kernel keeps cases here, checked
below."""


def _input_bytes(op_case: OpCase) -> int:
    return sum(a.size * a.dtype.itemsize for a in op_case.case.args if hasattr(a, "dtype"))


TORCH_TPU_CASES = [c for c in op_cases() if _input_bytes(c) <= INPUT_BYTES_LIMIT]


XLA_BACKWARDS = {
    "chunk_gated_delta_rule",
    "causal_conv1d",
    "gated_rms_norm",
    "mamba_chunk_scan_combined",
    "quantized_matmul",  # the activations' gradient through the dequantized weight (issue 37)
    "quantized_matmul_int4",  # the same, through the unpacked int4 weight
}
"""Ops whose backward is XLA, not a Pallas kernel (issue 26's kernels, as built)."""


def test_every_kernel_has_cases_on_torch_tpu():
    assert {c.kernel for c in TORCH_TPU_CASES} == {c.kernel for c in op_cases()}


@pytest.mark.parametrize(
    "op_case",
    TORCH_TPU_CASES,
    ids=lambda c: c.id,
)
def test_every_kernel_op_wraps_through_torch_tpu_jax_op(op_case: OpCase, wrapping):
    outputs, grads = run_forward_and_backward(op_case, inputs_on(lazy_device(), op_case))

    roles = [w.key[1] for w in wrapping.wrapped]
    assert roles == (["forward", "backward"] if op_case.case.differentiable else ["forward"])
    forward = wrapping.wrapped[0]
    assert forward.fake == fake_outputs(op_case), "TorchTPU's fake shapes differ from ours"
    assert [(tuple(t.shape), t.dtype) for t in tensor_leaves(outputs)] == forward.fake
    if grads is not None:
        wanted = [tuple(op_case.case.args[i].shape) for i in op_case.case.differentiable]
        # the backward returns a gradient per differentiable op argument given, in order; a case
        # may differentiate fewer (gated-delta-rule's cases leave the initial state out)
        assert [shape for shape, _ in wrapping.wrapped[1].fake][: len(wanted)] == wanted
        assert [tuple(g.shape) for g in grads] == wanted
    for wrapped in wrapping.wrapped:
        schema = _schema(wrapped.tpu_op)
        assert schema.startswith(f"{tpu_runtime.TPU_OP_NAMESPACE}::")
        assert schema.count("Tensor") >= len(wrapped.tensors) + len(wrapped.fake)
        op, role = wrapped.key[0].split("::")[-1], wrapped.key[1]
        if role == "forward" or op not in XLA_BACKWARDS:
            assert _exported_kernels(wrapped), f"{op} {role}: no Mosaic kernel for TPU"


def test_rms_norm_schemas_and_kernels(wrapping):
    k = get_kernel("rmsnorm")
    x = torch.zeros(32, 512, dtype=torch.bfloat16, device=lazy_device(), requires_grad=True)
    w = torch.zeros(512, dtype=torch.bfloat16, device=lazy_device(), requires_grad=True)
    k.rms_norm(x, w, 1e-5).sum().backward()

    forward, backward = wrapping.wrapped
    signatures = [re.sub(r"^[^(]*", "", _schema(w.tpu_op)) for w in (forward, backward)]
    assert signatures == [
        "(Tensor arg0, Tensor arg1) -> Tensor",
        "(Tensor[] arg0, Tensor[] arg1, Tensor[] arg2) -> (Tensor, Tensor)",
    ]
    assert forward.fake == [((32, 512), torch.bfloat16)]
    assert backward.fake == [((32, 512), torch.bfloat16), ((512,), torch.bfloat16)]
    assert _exported_kernels(forward) == ["rms_norm_forward"]
    assert _exported_kernels(backward) == ["rms_norm_forward", "rms_norm_backward"]


def test_a_torch_tpu_op_is_made_once_per_op_call_shape(wrapping):
    k = get_kernel("rmsnorm")
    w = torch.zeros(256, device=lazy_device())
    for eps, rows in ((1e-6, 8), (1e-6, 24), (1e-5, 8)):
        k.rms_norm(torch.zeros(rows, 256, device=lazy_device()), w, eps)
    ops = [wrapped.tpu_op for wrapped in wrapping.wrapped]
    assert ops[0] is ops[1], "a new shape must reuse the op (TorchTPU caches per shape)"
    assert ops[2] is not ops[0], "another eps is another compiled function, so another op"


def test_check_device_finds_jax_op():
    tpu_runtime.RUNTIME.check_device(torch.device("cpu"))
