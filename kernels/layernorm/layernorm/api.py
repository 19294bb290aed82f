"""Public JAX API: ``layer_norm`` with an implementation table (pallas, xla) and input checks."""

from __future__ import annotations

import functools
import math

import jax

from kernel_hub.kernel_api import (
    FLOATS_AND_F64,
    Einsum,
    RowBuckets,
    check_dtype,
    check_rank,
    float64_problem,
    jax_platform,
    op,
    pallas_and_xla,
    require,
)

from . import pallas_tpu, reference

OP = "layer_norm"


def check_inputs(x, weight, bias) -> None:
    """Shape and dtype rules shared by the JAX function and the torch ops."""
    check_rank(OP, "x", x, (1, 8))
    check_dtype(OP, "x", x, FLOATS_AND_F64)
    hidden = x.shape[-1]
    for name, param in (("weight", weight), ("bias", bias)):
        if param is None:
            continue
        check_dtype(OP, name, param, FLOATS_AND_F64)
        require(
            tuple(param.shape) == (hidden,),
            f"{OP}: {name} has shape {tuple(param.shape)} but x's hidden size is {hidden}; "
            f"{name} must have shape ({hidden},) or be None",
        )


def _pallas(x, weight, bias, *, eps, block_rows):
    hidden = x.shape[-1]
    rows = math.prod(x.shape[:-1])
    interpret = jax_platform() == "cpu"
    config = (
        pallas_tpu.BlockConfig(block_rows)
        if block_rows is not None
        else pallas_tpu.default_config(rows, hidden, x.dtype, interpret=interpret)
    )
    y = pallas_tpu.layer_norm_2d(x.reshape(rows, hidden), weight, bias, eps, config, interpret)
    return y.reshape(x.shape)


def _pallas_problem(x, weight, bias, *, eps, block_rows):
    if problem := float64_problem(x):
        return problem
    if math.prod(x.shape) == 0:
        return "empty input (no rows or no hidden units)"
    if block_rows is None:
        return None
    rows = math.prod(x.shape[:-1])
    return pallas_tpu.config_problem(rows, x.dtype, pallas_tpu.BlockConfig(block_rows))


def _xla(x, weight, bias, *, eps, block_rows):
    return reference.layer_norm(x, weight, bias, eps)


TABLE = pallas_and_xla(OP, _pallas, _xla, _pallas_problem)

# Sharding: rows split freely, the normalised axis stays whole (its mean and variance need every
# column); a replicated weight's and bias's gradients are summed over the shards by the
# boundary's transpose.
_WHOLE = {
    "whole": ("hidden",),
    "handled_by": {
        "hidden": "an all-gather of x before the norm (the statistics need every column)"
    },
}
# Rows are independent, so the torch ops flatten leading dims and pad them to power-of-two
# buckets: varying sequence lengths compile a handful of shapes, not one per length.
_BUCKETS = RowBuckets(inputs=("x",), outputs=(0,))
# A torch op's differentiable arguments are tensors, so each affine form is its own torch op:
# ``layer_norm`` (weight and bias), ``layer_norm_no_bias`` (weight only, e.g. ModernBERT) and
# ``layer_norm_no_affine`` (``elementwise_affine=False``, e.g. Flux).


@op(
    check=check_inputs,
    differentiable=("x", "weight", "bias"),
    sharding=Einsum("... hidden, hidden, hidden -> ... hidden", **_WHOLE),
    jax_only=("block_rows",),
    torch_required=("weight", "bias"),
    buckets=_BUCKETS,
)
def layer_norm(
    x: jax.Array,
    weight: jax.Array | None = None,
    bias: jax.Array | None = None,
    eps: float = 1e-5,
    *,
    implementation: str | None = None,
    block_rows: int | None = None,
) -> jax.Array:
    """Normalise the last axis of ``x`` to zero mean and unit (biased) variance, then scale by
    ``weight`` and shift by ``bias`` when given; any leading shape.

    Statistics and the affine step run in f32 (f64 for f64 inputs); the result has ``x``'s dtype,
    as ``torch.nn.functional.layer_norm``. ``implementation`` forces one ("pallas" or "xla"); by
    default the platform's order is tried. ``block_rows`` overrides the Pallas row block.
    """
    return TABLE(x, weight, bias, eps=eps, block_rows=block_rows, implementation=implementation)


@op(
    check=functools.partial(check_inputs, bias=None),
    differentiable=("x", "weight"),
    sharding=Einsum("... hidden, hidden -> ... hidden", **_WHOLE),
    jax_only=("block_rows",),
    buckets=_BUCKETS,
)
def layer_norm_no_bias(
    x: jax.Array,
    weight: jax.Array,
    eps: float = 1e-5,
    *,
    implementation: str | None = None,
    block_rows: int | None = None,
) -> jax.Array:
    """``layer_norm`` with a weight and no bias (``bias=False``), the torch op of that name."""
    return layer_norm(x, weight, None, eps, implementation=implementation, block_rows=block_rows)


@op(
    check=functools.partial(check_inputs, weight=None, bias=None),
    differentiable=("x",),
    sharding=Einsum("... hidden -> ... hidden", **_WHOLE),
    jax_only=("block_rows",),
    buckets=_BUCKETS,
)
def layer_norm_no_affine(
    x: jax.Array,
    eps: float = 1e-5,
    *,
    implementation: str | None = None,
    block_rows: int | None = None,
) -> jax.Array:
    """``layer_norm`` with neither weight nor bias (``elementwise_affine=False``)."""
    return layer_norm(x, None, None, eps, implementation=implementation, block_rows=block_rows)
