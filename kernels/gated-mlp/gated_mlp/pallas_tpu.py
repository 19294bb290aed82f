"""Pallas gated activation for TPU: ``act(gate) * up`` over [rows, columns] blocks.

The backward recomputes ``act(gate)`` and its derivative from the saved inputs instead of
storing the activation (one [rows, intermediate] tensor less per MLP in training). The fused
layout (Phi-3's ``gate_up_proj``: [rows, 2I], gate first) is read in place: the same array is
passed twice with the up half's blocks offset by I / block_cols, so no split copy is made.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernel_hub.kernel_api import tiling

from .reference import activation, activation_and_derivative, compute_dtype

_ROWS = 256
_COLS = (2048, 1024, 512, 256, 128)


@dataclass(frozen=True)
class BlockConfig:
    """Rows (a multiple of 8/16, or all) and columns (a multiple of 128 dividing the
    intermediate size, or all of it for the separate layout) per grid step."""

    block_rows: int
    block_cols: int


def default_config(rows: int, columns: int) -> BlockConfig | None:
    """Blocks for ``columns`` intermediate features; None when no lane-aligned block divides
    them (the fused layout then needs its halves split first)."""
    cols = next((c for c in _COLS if columns % c == 0), None)
    if cols is None:
        return None
    return BlockConfig(min(_ROWS, rows), cols)


def config_problem(rows: int, columns: int, dtype, config: BlockConfig, fused: bool):
    """Why a block config is illegal for TPU tiling or the layout, or None."""
    problems = []
    rows_problem = tiling.row_block_problem(rows, config.block_rows, dtype)
    if rows_problem is not None:
        problems.append(rows_problem)
    bc = config.block_cols
    aligned = bc > 0 and bc % 128 == 0 and columns % bc == 0
    if not (aligned or (bc == columns and not fused)):
        problems.append(
            f"block_cols={bc} must be a multiple of 128 dividing the intermediate size ({columns})"
            + ("" if fused else ", or equal it")
        )
    return "; ".join(problems) or None


def _forward_kernel(g_ref, u_ref, y_ref, *, name: str):
    acc = compute_dtype(g_ref.dtype)
    y = activation(g_ref[...].astype(acc), name) * u_ref[...].astype(acc)
    y_ref[...] = y.astype(y_ref.dtype)


def _backward_kernel(g_ref, u_ref, dy_ref, dg_ref, du_ref, *, name: str):
    acc = compute_dtype(g_ref.dtype)
    act, slope = activation_and_derivative(g_ref[...].astype(acc), name)
    dy = dy_ref[...].astype(acc)
    dg_ref[...] = (dy * u_ref[...].astype(acc) * slope).astype(dg_ref.dtype)
    du_ref[...] = (dy * act).astype(du_ref.dtype)


def _specs(config: BlockConfig, up_offset: int):
    gate = pl.BlockSpec((config.block_rows, config.block_cols), lambda i, j: (i, j))
    up = pl.BlockSpec((config.block_rows, config.block_cols), lambda i, j: (i, j + up_offset))
    return gate, up


def _grid(rows: int, columns: int, config: BlockConfig):
    return (pl.cdiv(rows, config.block_rows), columns // config.block_cols)


def _operands(x, up):
    """(gate source, up source, intermediate size, up block offset) for either layout."""
    if up is None:
        columns = x.shape[1] // 2
        return x, x, columns
    return x, up, x.shape[1]


_PARAMS = tiling.compiler_params("parallel", "parallel")


def forward(x, up, name: str, config: BlockConfig, interpret: bool):
    gate_src, up_src, columns = _operands(x, up)
    rows = x.shape[0]
    offset = columns // config.block_cols if up is None else 0
    gate, up_spec = _specs(config, offset)
    out = pl.BlockSpec((config.block_rows, config.block_cols), lambda i, j: (i, j))
    itemsize = x.dtype.itemsize
    return pl.pallas_call(
        functools.partial(_forward_kernel, name=name),
        grid=_grid(rows, columns, config),
        in_specs=[gate, up_spec],
        out_specs=out,
        out_shape=jax.ShapeDtypeStruct((rows, columns), x.dtype),
        compiler_params=_PARAMS,
        cost_estimate=pl.CostEstimate(
            flops=8 * rows * columns,
            transcendentals=rows * columns,
            bytes_accessed=3 * rows * columns * itemsize,
        ),
        interpret=interpret,
        name="gated_activation_forward",
    )(gate_src, up_src)


def backward(x, up, dy, name: str, config: BlockConfig, interpret: bool):
    """(d gate, d up), each [rows, I]."""
    gate_src, up_src, columns = _operands(x, up)
    rows = x.shape[0]
    offset = columns // config.block_cols if up is None else 0
    gate, up_spec = _specs(config, offset)
    block = pl.BlockSpec((config.block_rows, config.block_cols), lambda i, j: (i, j))
    half = jax.ShapeDtypeStruct((rows, columns), x.dtype)
    itemsize = x.dtype.itemsize
    return pl.pallas_call(
        functools.partial(_backward_kernel, name=name),
        grid=_grid(rows, columns, config),
        in_specs=[gate, up_spec, block],
        out_specs=[block, block],
        out_shape=[half, half],
        compiler_params=_PARAMS,
        cost_estimate=pl.CostEstimate(
            flops=16 * rows * columns,
            transcendentals=2 * rows * columns,
            bytes_accessed=5 * rows * columns * itemsize,
        ),
        interpret=interpret,
        name="gated_activation_backward",
    )(gate_src, up_src, dy)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def gated_activation_2d(x, up, name: str, config: BlockConfig, interpret: bool):
    """``act(gate) * up`` of [rows, I] arrays; ``up=None``: ``x`` is [rows, 2I], gate first."""
    return forward(x, up, name, config, interpret)


def _fwd(x, up, name, config, interpret):
    return forward(x, up, name, config, interpret), (x, up)


def _bwd(name, config, interpret, residuals, dy):
    x, up = residuals
    d_gate, d_up = backward(x, up, dy, name, config, interpret)
    if up is None:
        return jnp.concatenate([d_gate, d_up], axis=1), None
    return d_gate, d_up


gated_activation_2d.defvjp(_fwd, _bwd)
