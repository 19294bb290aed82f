"""The gmm and tgmm torch ops, built with kernel-hub's bridge; their backward ops run the
backward kernels directly (``api.gmm_vjp`` / ``api.tgmm_vjp``)."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

from kernel_hub.bridge import jax_op, op_namespace, torch_to_jax_dtype

from . import api


def _jax_dtype(dtype: torch.dtype | None):
    return None if dtype is None else torch_to_jax_dtype(dtype)


def _gmm_jax(lhs, rhs, group_sizes, *, transpose_rhs, preferred_element_type, implementation):
    return api.gmm(
        lhs, rhs, group_sizes, transpose_rhs=transpose_rhs,
        preferred_element_type=_jax_dtype(preferred_element_type), implementation=implementation,
    )


def _tgmm_jax(lhs, grad, group_sizes, *, preferred_element_type, implementation):
    return api.tgmm(
        lhs, grad, group_sizes, preferred_element_type=_jax_dtype(preferred_element_type),
        implementation=implementation,
    )


def _gmm_backward(inputs, outputs, cotangents, *, transpose_rhs, preferred_element_type,
                  implementation):
    return api.gmm_vjp(
        inputs["lhs"], inputs["rhs"], inputs["group_sizes"], cotangents[0],
        transpose_rhs=transpose_rhs, implementation=implementation,
    )


def _tgmm_backward(inputs, outputs, cotangents, *, preferred_element_type, implementation):
    return api.tgmm_vjp(
        inputs["lhs"], inputs["grad"], inputs["group_sizes"], cotangents[0],
        implementation=implementation,
    )


def _check_sizes_when_readable(op: str, group_sizes: torch.Tensor, rows: int) -> None:
    """Check group size values of real CPU tensors; fake tensors (torch.compile tracing) have
    none, and reading an accelerator tensor would stall it (see ``api`` for what happens then)."""
    if group_sizes.device.type == "cpu" and not is_fake(group_sizes):
        api.check_group_size_values(op, group_sizes.tolist(), rows)


# The backward runs only the two backward kernels: no forward recomputed (and left to DCE).
@jax_op(
    op_namespace(__name__), _gmm_jax, differentiable=("lhs", "rhs"), jax_backward=_gmm_backward
)
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
    op_namespace(__name__), _tgmm_jax, differentiable=("lhs", "grad"), jax_backward=_tgmm_backward
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
