"""The gmm, tgmm and gmm_quantized torch ops, built with kernel-hub's bridge; their backward ops
run the backward kernels directly (``api.gmm_vjp`` / ``api.tgmm_vjp`` /
``api.gmm_quantized_vjp``)."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

from kernel_hub.kernel_api import jax_op, op_namespace

from . import api, quantized


def _gmm_backward(
    inputs, outputs, cotangents, *, transpose_rhs, preferred_element_type, implementation
):
    return api.gmm_vjp(
        inputs["lhs"],
        inputs["rhs"],
        inputs["group_sizes"],
        cotangents[0],
        transpose_rhs=transpose_rhs,
        implementation=implementation,
    )


def _tgmm_backward(inputs, outputs, cotangents, *, preferred_element_type, implementation):
    return api.tgmm_vjp(
        inputs["lhs"],
        inputs["grad"],
        inputs["group_sizes"],
        cotangents[0],
        implementation=implementation,
    )


def _check_sizes_when_readable(op: str, group_sizes: torch.Tensor, rows: int) -> None:
    """Check group size values of real CPU tensors; fake tensors (torch.compile tracing) have
    none, and reading an accelerator tensor would stall it (see ``api`` for what happens then)."""
    if group_sizes.device.type == "cpu" and not is_fake(group_sizes):
        api.check_group_size_values(op, group_sizes.tolist(), rows)


# The backward runs only the two backward kernels: no forward recomputed (and left to DCE).
@jax_op(op_namespace(__name__), api.gmm, differentiable=("lhs", "rhs"), jax_backward=_gmm_backward)
def gmm(
    lhs: torch.Tensor,
    rhs: torch.Tensor,
    group_sizes: torch.Tensor,
    transpose_rhs: bool = False,
    preferred_element_type: torch.dtype | None = None,
    implementation: str | None = None,
) -> torch.Tensor:
    """Grouped matmul [m, k] x [E, k, n] (or [E, n, k] with transpose_rhs) -> [m, n]; see
    ``api.gmm``."""
    api.check_gmm_inputs(lhs, rhs, group_sizes, transpose_rhs)
    _check_sizes_when_readable("gmm", group_sizes, lhs.shape[0])


@jax_op(
    op_namespace(__name__), api.tgmm, differentiable=("lhs", "grad"), jax_backward=_tgmm_backward
)
def tgmm(
    lhs: torch.Tensor,
    grad: torch.Tensor,
    group_sizes: torch.Tensor,
    preferred_element_type: torch.dtype | None = None,
    implementation: str | None = None,
) -> torch.Tensor:
    """Per-group lhs^T @ grad: [m, k], [m, n] -> [E, k, n]; see ``api.tgmm``."""
    api.check_tgmm_inputs(lhs, grad, group_sizes)
    _check_sizes_when_readable("tgmm", group_sizes, lhs.shape[0])


def _gmm_quantized_backward(
    inputs, outputs, cotangents, *, transpose_rhs, preferred_element_type, implementation
):
    return (
        api.gmm_quantized_vjp(
            inputs["lhs"],
            inputs["weight"],
            inputs["scale"],
            inputs["group_sizes"],
            cotangents[0],
            transpose_rhs=transpose_rhs,
            implementation=implementation,
        ),
    )


@jax_op(
    op_namespace(__name__),
    api.gmm_quantized,
    differentiable=("lhs",),
    frozen=("weight", "scale"),
    jax_backward=_gmm_quantized_backward,
)
def gmm_quantized(
    lhs: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    group_sizes: torch.Tensor,
    transpose_rhs: bool = True,
    preferred_element_type: torch.dtype | None = None,
    implementation: str | None = None,
) -> torch.Tensor:
    """Grouped matmul with int8 / fp8 expert weights [E, out, in] and their scales; see
    ``api.gmm_quantized``. Differentiable in ``lhs`` only: quantized weights are frozen, and a
    weight or scale that requires grad (in grad mode) is refused before any kernel runs."""
    quantized.check_inputs(lhs, weight, scale, group_sizes, transpose_rhs)
    _check_sizes_when_readable("gmm_quantized", group_sizes, lhs.shape[0])
