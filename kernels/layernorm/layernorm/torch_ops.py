"""The layer_norm torch ops, built with kernel-hub's bridge.

A torch op's differentiable arguments are tensors, never None, so each affine form is its own op:
``layer_norm`` (weight and bias), ``layer_norm_no_bias`` (weight only, e.g. ModernBERT) and
``layer_norm_no_affine`` (``elementwise_affine=False``, e.g. Flux). ``layer_norm_any`` picks one.
"""

from __future__ import annotations

import torch

from kernel_hub.kernel_api import RowBuckets, jax_op, op_namespace

from . import api

_NAMESPACE = op_namespace(__name__)
# Rows are independent, so leading dims are flattened and padded to power-of-two buckets: varying
# sequence lengths compile a handful of shapes, not one per length.
_BUCKETS = RowBuckets(inputs=("x",), outputs=(0,))


@jax_op(_NAMESPACE, api.layer_norm, differentiable=("x", "weight", "bias"), buckets=_BUCKETS)
def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float = 1e-5,
    implementation: str | None = None,
) -> torch.Tensor:
    """LayerNorm over the last dimension of ``x`` with weight and bias; see ``api.layer_norm``."""
    api.check_inputs(x, weight, bias)


@jax_op(_NAMESPACE, api.layer_norm_no_bias, differentiable=("x", "weight"), buckets=_BUCKETS)
def layer_norm_no_bias(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5, implementation: str | None = None
) -> torch.Tensor:
    """LayerNorm over the last dimension of ``x``, scaled by ``weight``, no bias."""
    api.check_inputs(x, weight, None)


@jax_op(_NAMESPACE, api.layer_norm_no_affine, differentiable=("x",), buckets=_BUCKETS)
def layer_norm_no_affine(
    x: torch.Tensor, eps: float = 1e-5, implementation: str | None = None
) -> torch.Tensor:
    """LayerNorm over the last dimension of ``x``, no weight and no bias."""
    api.check_inputs(x, None, None)


def layer_norm_any(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float = 1e-5,
    implementation: str | None = None,
) -> torch.Tensor:
    """The op for whichever of weight and bias are given (a bias alone gets a unit weight)."""
    if bias is not None:
        if weight is None:
            weight = torch.ones_like(bias)
        return layer_norm(x, weight, bias, eps, implementation)
    if weight is not None:
        return layer_norm_no_bias(x, weight, eps, implementation)
    return layer_norm_no_affine(x, eps, implementation)
