"""Block-size rules shared by Pallas TPU kernels, so each kernel states only its own numbers.

Row-blocked kernels (norms and other row-wise ops that hold whole rows in VMEM) pick a row block
from a VMEM budget: ``vmem_bytes_per_row`` prices one row from what the kernel streams and keeps,
``row_block`` picks the largest legal block that fits, ``row_block_problem`` says why a
user-given block is illegal. ``sublane_multiple`` is the TPU tiling rule behind all three (the
second-to-last block dimension is a multiple of it, or the whole array dimension), and
``compiler_params`` builds Mosaic's parameters from the grid's dimension semantics.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

VMEM_BUDGET_BYTES = 8 * 1024 * 1024
"""Half of v4's 16 MiB default scoped VMEM: a block that fits it fits every generation, with room
for Mosaic's own scratch."""
MAX_BLOCK_ROWS = 1024
"""Beyond this many rows a bigger block no longer shortens a memory-bound kernel measurably."""
F32_BYTES = 4


def sublane_multiple(dtype: Any) -> int:
    """Rows in one TPU vreg tile: 8 for 32-bit, 16 for 16-bit, 32 for 8-bit types."""
    return 8 * max(1, 4 // jnp.dtype(dtype).itemsize)


def vmem_bytes_per_row(
    width: int, itemsize: int, *, streamed: int, f32_temporaries: int, buffers: int = 2
) -> int:
    """VMEM one row of a row block needs: ``streamed`` [rows, width] blocks in and out (each
    ``buffers``-deep in Pallas' pipeline) of ``itemsize`` bytes, plus ``f32_temporaries`` f32
    [rows, width] values the kernel body keeps live at once (count them in its larger pass)."""
    return width * (streamed * buffers * itemsize + f32_temporaries * F32_BYTES)


def row_block(
    rows: int,
    bytes_per_row: int,
    dtype: Any,
    *,
    budget: int = VMEM_BUDGET_BYTES,
    max_rows: int = MAX_BLOCK_ROWS,
) -> int:
    """The largest row block within ``budget`` that is a multiple of the dtype's sublane tile (at
    least one tile, even over budget), or all ``rows`` when they fit in one such block."""
    multiple = sublane_multiple(dtype)
    fit = min(max_rows, budget // max(1, bytes_per_row))
    block = max(multiple, fit // multiple * multiple)
    return rows if rows <= block else block


def row_block_problem(rows: int, block_rows: int, dtype: Any) -> str | None:
    """Why ``block_rows`` is not a legal row block for ``rows`` rows of ``dtype``, or None."""
    multiple = sublane_multiple(dtype)
    if block_rows == rows or (block_rows > 0 and block_rows % multiple == 0):
        return None
    return f"block_rows={block_rows} must equal rows ({rows}) or be a multiple of {multiple}"


def compiler_params(*semantics: str, vmem_limit_bytes: int | None = None) -> Any:
    """``pltpu.CompilerParams`` for a grid with these dimension semantics (``"parallel"``: steps
    are independent and may be split across TensorCores; ``"arbitrary"``: sequential, e.g. an
    accumulation axis), optionally raising the scoped VMEM limit."""
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.CompilerParams(dimension_semantics=semantics, vmem_limit_bytes=vmem_limit_bytes)
