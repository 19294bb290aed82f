"""What a Pallas TPU call's block schedule moves and multiplies, counted by walking its grid.

A ``pallas_call`` contributes to ``compiled.cost_analysis()`` only the ``pl.CostEstimate`` its
author declared, so a kernel's bytes and FLOPs are only as honest as that estimate. This module
counts them independently from the call itself, so a test can hold the declared estimate to it:

- bytes: Pallas's pipeline copies an operand's block into VMEM when its block index differs from
  the previous grid step's (an unchanged index is not fetched again), and copies an output block
  back when its index changes and after the last step. Each copy moves the block's part inside
  the array (edge blocks are clipped), at the array's logical size (no tile padding).
- FLOPs: ``2 * m * n * k`` for each ``dot_general`` at the top level of the kernel body (not
  inside ``pl.when`` branches), times the grid's steps; the block shapes, so ragged edges count
  whole blocks, as the MXU runs them. Elementwise work is not counted.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np


def pallas_calls(fn: Callable[..., Any], *args: Any) -> list[Any]:
    """The ``pallas_call`` equations ``fn(*args)`` traces to, in program order."""
    return list(_walk(jax.make_jaxpr(fn)(*args).jaxpr))


def _walk(jaxpr) -> Iterator[Any]:
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            yield eqn
            continue
        for param in eqn.params.values():
            for inner in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(inner, "jaxpr", inner)
                if hasattr(inner, "eqns"):
                    yield from _walk(inner)


def _block_extent(dim: Any) -> int:
    """A block dimension's size: ``Blocked(n)`` is n rows, a squeezed (None) dimension one."""
    return getattr(dim, "block_size", 1)


def _steps(grid: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
    return itertools.product(*(range(n) for n in grid))


def _block_bytes(mapping, index: tuple[int, ...]) -> int:
    """Bytes of the block at ``index`` that lie inside the array."""
    shape = mapping.array_aval.shape
    sizes = [_block_extent(d) for d in mapping.block_shape]
    inside = [
        max(0, min(size, extent - i * size))
        for i, size, extent in zip(index, sizes, shape, strict=True)
    ]
    return math.prod(inside) * np.dtype(mapping.array_aval.dtype).itemsize


def _indices(mapping, grid: tuple[int, ...]) -> list[tuple[int, ...]]:
    closed = mapping.index_map_jaxpr
    return [
        tuple(int(i) for i in jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *step))
        for step in _steps(grid)
    ]


def bytes_moved(eqn) -> int:
    """HBM <-> VMEM bytes of one ``pallas_call`` equation's pipelined operands and outputs."""
    mapping = eqn.params["grid_mapping"]
    if mapping.num_index_operands or mapping.num_dynamic_grid_bounds:
        raise ValueError("scalar-prefetch and dynamic grids are not counted here")
    grid = tuple(mapping.grid)
    total = 0
    for position, block in enumerate(mapping.block_mappings):
        indices = _indices(block, grid)
        changes = [i for step, i in enumerate(indices) if step == 0 or i != indices[step - 1]]
        if position >= mapping.num_inputs:  # an output: written when its index moves on, and last
            changes = [i for step, i in enumerate(indices[:-1]) if i != indices[step + 1]]
            changes.append(indices[-1])
        total += sum(_block_bytes(block, i) for i in changes)
    return total


def matmul_flops(eqn) -> int:
    """``2 * m * n * k`` of the kernel body's top-level dots, times the grid's steps."""
    mapping = eqn.params["grid_mapping"]
    per_step = 0
    for inner in eqn.params["jaxpr"].eqns:
        if inner.primitive.name != "dot_general":
            continue
        (contract, _), _ = inner.params["dimension_numbers"]
        lhs = inner.invars[0].aval.shape
        k = math.prod(lhs[d] for d in contract)
        per_step += 2 * math.prod(inner.outvars[0].aval.shape) * k
    return per_step * math.prod(mapping.grid)
