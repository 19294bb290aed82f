"""The quantized_matmul torch op, built with kernel-hub's bridge."""

from __future__ import annotations

import torch

from kernel_hub.kernel_api import RowBuckets, jax_op, op_namespace

from . import api


# Rows are independent: leading dims are flattened and padded to power-of-two buckets, so a
# decode loop compiles a handful of shapes, not one per length.
@jax_op(
    op_namespace(__name__),
    api.quantized_matmul,
    differentiable=("x",),
    frozen=("weight", "scale"),
    buckets=RowBuckets(inputs=("x",), outputs=(0,)),
)
def quantized_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    preferred_element_type: torch.dtype | None = None,
    implementation: str | None = None,
) -> torch.Tensor:
    """``x @ W^T`` with W = ``weight`` (int8 [out, in] or float8_e4m3fn [out, in]) times its
    ``scale`` (int8: [out]; fp8: [ceil(out / 128), ceil(in / 128)]), kept quantized; see
    ``api.quantized_matmul``. Differentiable in ``x`` only: a weight or scale that requires grad
    (in grad mode) is refused before any kernel runs."""
    api.check_inputs(x, weight, scale)
