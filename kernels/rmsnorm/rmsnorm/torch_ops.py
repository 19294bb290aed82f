"""The rms_norm torch op, built with kernel-hub's bridge."""

from __future__ import annotations

import torch

from kernel_hub.kernel_api import RowBuckets, jax_op, op_namespace

from . import api, gated


# Rows are independent, so leading dims are flattened and padded to power-of-two buckets: a
# decode loop or varying prompt lengths compile a handful of shapes, not one per length.
@jax_op(
    op_namespace(__name__),
    api.rms_norm,
    differentiable=("x", "weight"),
    buckets=RowBuckets(inputs=("x",), outputs=(0,)),
)
def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    implementation: str | None = None,
    weight_offset: float = 0.0,
    rounding: str = "promoted",
) -> torch.Tensor:
    """RMSNorm over the last dimension of ``x``, scaled by ``weight + weight_offset``, rounded
    as ``rounding`` says; see ``api.rms_norm``."""
    api.check_inputs(x, weight, weight_offset, rounding)


@jax_op(op_namespace(__name__), gated.gated_rms_norm, differentiable=("x", "gate", "weight"))
def gated_rms_norm(
    x: torch.Tensor,
    gate: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float = 1e-6,
    norm_before_gate: bool = True,
    group_size: int | None = None,
    implementation: str | None = None,
) -> torch.Tensor:
    """Gated RMSNorm (``RMSNormGated``) over the last dimension; see ``gated``."""
    gated.check_inputs(x, gate, weight, norm_before_gate, group_size)
