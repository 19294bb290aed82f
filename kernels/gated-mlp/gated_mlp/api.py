"""Public JAX API: ``gated_activation`` with an implementation table (pallas, xla) and checks."""

from __future__ import annotations

import math

import jax

from kernel_hub.kernel_api import (
    FLOATS_AND_F64,
    Einsum,
    RowBuckets,
    check_dtype,
    check_rank,
    check_same_dtype,
    float64_problem,
    jax_platform,
    op,
    pallas_and_xla,
    require,
)

from . import pallas_tpu, reference
from .reference import ACTIVATIONS

OP = "gated_activation"


def check_inputs(x, up=None, activation: str = "silu") -> None:
    """Shape, dtype and option rules shared by the JAX function and the torch op."""
    require(
        activation in ACTIVATIONS,
        f"{OP}: activation={activation!r}; valid: {', '.join(ACTIVATIONS)}",
    )
    check_rank(OP, "x", x, (1, 8))
    check_dtype(OP, "x", x, FLOATS_AND_F64)
    if up is None:
        require(
            x.shape[-1] % 2 == 0,
            f"{OP}: fused gate_up x has an odd last dimension ({x.shape[-1]}); it must be "
            "[..., 2 * intermediate] with the gate half first",
        )
        return
    check_same_dtype(OP, "x", x, "up", up)
    require(
        tuple(up.shape) == tuple(x.shape),
        f"{OP}: gate has shape {tuple(x.shape)} but up has {tuple(up.shape)}; they must match",
    )


def _rows_columns(x, up):
    columns = x.shape[-1] if up is not None else x.shape[-1] // 2
    return math.prod(x.shape[:-1]), columns


def _config(x, up, block_rows, block_cols):
    rows, columns = _rows_columns(x, up)
    default = pallas_tpu.default_config(rows, columns)
    if default is None:
        default = pallas_tpu.BlockConfig(min(256, rows), columns)
    return pallas_tpu.BlockConfig(
        block_rows or default.block_rows, block_cols or default.block_cols
    )


def _pallas(x, up, *, activation, block_rows, block_cols):
    rows, columns = _rows_columns(x, up)
    config = _config(x, up, block_rows, block_cols)
    interpret = jax_platform() == "cpu"
    x2 = x.reshape(rows, x.shape[-1])
    up2 = None if up is None else up.reshape(rows, columns)
    y = pallas_tpu.gated_activation_2d(x2, up2, activation, config, interpret)
    return y.reshape(*x.shape[:-1], columns)


def _pallas_problem(x, up, *, activation, block_rows, block_cols):
    if problem := float64_problem(x):
        return problem
    rows, columns = _rows_columns(x, up)
    config = _config(x, up, block_rows, block_cols)
    return pallas_tpu.config_problem(rows, columns, x.dtype, config, fused=up is None)


def _xla(x, up, *, activation, block_rows, block_cols):
    if up is None:
        x, up = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return reference.gated_activation(x, up, activation)


TABLE = pallas_and_xla(OP, _pallas, _xla, _pallas_problem)

# Separate gate and up: rows and intermediate features both split freely (the product is
# elementwise), so a tensor-parallel MLP's column-split gate/up outputs stay where they are.
_SEPARATE = Einsum("... intermediate, ... intermediate -> ... intermediate")
# Fused gate_up ([..., 2I], gate half first; ``up`` absent): a split of the last dimension would
# separate gate columns from their up columns, so it stays whole.
_FUSED = Einsum(
    "... gate_up, ... gate_up -> ... gate_up",
    whole=("gate_up",),
    handled_by={"gate_up": "separate gate and up arrays (up=...), whose features split"},
)


def sharding_rule(ranks: tuple = (), **options) -> Einsum:
    """The separate layout's rule when ``up`` is given (``ranks[1]``), else the fused one's."""
    return _SEPARATE if len(ranks) > 1 and ranks[1] is not None else _FUSED


@op(
    check=check_inputs,
    differentiable=("x", "up"),
    sharding=sharding_rule,
    jax_only=("block_rows", "block_cols"),
    # Rows are independent: the torch op flattens leading dims and pads them to power-of-two
    # buckets.
    buckets=RowBuckets(inputs=("x", "up"), outputs=(0,)),
    autocast=("x", "up"),
)
def gated_activation(
    x: jax.Array,
    up: jax.Array | None = None,
    activation: str = "silu",
    *,
    implementation: str | None = None,
    block_rows: int | None = None,
    block_cols: int | None = None,
) -> jax.Array:
    """``act(gate) * up`` with ``gate = x`` ([..., I], any leading shape), or, with ``up=None``,
    ``gate, up = x[..., :I], x[..., I:]`` (the fused ``gate_up_proj`` layout, [..., 2I]).

    The math runs in f32 (f64 for f64), rounded once to the inputs' dtype; the backward
    recomputes the activation. ``activation``: ``reference.ACTIVATIONS``.
    """
    return TABLE(
        x,
        up,
        activation=activation,
        block_rows=block_rows,
        block_cols=block_cols,
        implementation=implementation,
    )
