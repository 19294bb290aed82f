"""The gated_activation torch op, built with kernel-hub's bridge."""

from __future__ import annotations

import torch

from kernel_hub.kernel_api import RowBuckets, jax_op, op_namespace

from . import api


# Rows are independent: leading dims are flattened and padded to power-of-two buckets.
@jax_op(
    op_namespace(__name__),
    api.gated_activation,
    differentiable=("x", "up"),
    buckets=RowBuckets(inputs=("x", "up"), outputs=(0,)),
    autocast=("x", "up"),
)
def gated_activation(
    x: torch.Tensor,
    up: torch.Tensor | None = None,
    activation: str = "silu",
    implementation: str | None = None,
) -> torch.Tensor:
    """``act(x) * up``, or with ``up=None`` ``act(x[..., :I]) * x[..., I:]``; see
    ``api.gated_activation``."""
    api.check_inputs(x, up, activation)
