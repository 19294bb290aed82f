"""Public JAX API: ``rms_norm`` with an implementation table (pallas, xla) and input checks."""

from __future__ import annotations

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
from .gated import TABLE as GATED_TABLE
from .gated import gated_rms_norm

OP = "rms_norm"
__all__ = ["GATED_TABLE", "TABLE", "gated_rms_norm", "rms_norm"]


def check_inputs(x, weight, weight_offset: float = 0.0, rounding: str = "promoted") -> None:
    """Shape, dtype and option rules shared by the JAX function and the torch op."""
    require(
        rounding in reference.ROUNDINGS,
        f"{OP}: rounding={rounding!r}; valid: {', '.join(reference.ROUNDINGS)}",
    )
    require(
        isinstance(weight_offset, (int, float)) and not isinstance(weight_offset, bool),
        f"{OP}: weight_offset={weight_offset!r}; it must be a number (0.0, or 1.0 for Gemma)",
    )
    check_rank(OP, "x", x, (1, 8))
    check_rank(OP, "weight", weight, 1)
    check_dtype(OP, "x", x, FLOATS_AND_F64)
    check_dtype(OP, "weight", weight, FLOATS_AND_F64)
    require(
        tuple(weight.shape) == (x.shape[-1],),
        f"{OP}: weight has shape {tuple(weight.shape)} but x's hidden size is {x.shape[-1]}; "
        f"weight must have shape ({x.shape[-1]},)",
    )


def _pallas(x, weight, *, eps, block_rows, weight_offset, rounding):
    hidden = x.shape[-1]
    rows = math.prod(x.shape[:-1])
    interpret = jax_platform() == "cpu"
    config = (
        pallas_tpu.BlockConfig(block_rows)
        if block_rows is not None
        else pallas_tpu.default_config(rows, hidden, x.dtype, interpret=interpret)
    )
    form = pallas_tpu.Form(float(weight_offset), rounding)
    y = pallas_tpu.rms_norm_2d(x.reshape(rows, hidden), weight, eps, config, form, interpret)
    return y.reshape(x.shape)


def _pallas_problem(x, weight, *, eps, block_rows, weight_offset, rounding):
    if problem := float64_problem(x):
        return problem
    if block_rows is None:
        return None
    rows = math.prod(x.shape[:-1])
    return pallas_tpu.config_problem(rows, x.dtype, pallas_tpu.BlockConfig(block_rows))


def _xla(x, weight, *, eps, block_rows, weight_offset, rounding):
    return reference.rms_norm(x, weight, eps, float(weight_offset), rounding)


TABLE = pallas_and_xla(OP, _pallas, _xla, _pallas_problem)


# Sharding: rows split freely, the normalised axis stays whole. Rows are independent, so the torch
# op flattens leading dims and pads them to power-of-two buckets: a decode loop or varying prompt
# lengths compile a handful of shapes, not one per length.
@op(
    check=check_inputs,
    differentiable=("x", "weight"),
    sharding=Einsum(
        "... hidden, hidden -> ... hidden",
        whole=("hidden",),
        handled_by={
            "hidden": "an all-gather of x before the norm (the statistics need every column)"
        },
    ),
    jax_only=("block_rows",),
    buckets=RowBuckets(inputs=("x",), outputs=(0,)),
)
def rms_norm(
    x: jax.Array,
    weight: jax.Array,
    eps: float = 1e-6,
    *,
    implementation: str | None = None,
    block_rows: int | None = None,
    weight_offset: float = 0.0,
    rounding: str = "promoted",
) -> jax.Array:
    """RMS-normalise the last axis of ``x`` and scale by ``weight + weight_offset``; any leading
    shape.

    Statistics are computed in f32 (f64 for f64 inputs). ``rounding`` says where the result is
    rounded and so its dtype (``reference.ROUNDINGS``): by default once, to the promoted dtype of
    ``x`` and ``weight``. ``weight_offset=1.0`` with ``rounding="input"`` is Gemma's norm.
    ``implementation`` forces one ("pallas" or "xla"); by default the platform's order is tried.
    ``block_rows`` overrides the Pallas row block.
    """
    return TABLE(
        x,
        weight,
        eps=eps,
        block_rows=block_rows,
        weight_offset=weight_offset,
        rounding=rounding,
        implementation=implementation,
    )
