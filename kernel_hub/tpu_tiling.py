"""Block-size rules shared by Pallas TPU kernels, so each kernel states only its own numbers.

Row-blocked kernels (norms and other row-wise ops that hold whole rows in VMEM) pick a row block
from a VMEM budget: ``vmem_bytes_per_row`` prices one row from what the kernel streams and keeps,
``row_block`` picks the largest legal block that fits, ``row_block_problem`` says why a
user-given block is illegal. ``vmem_budget`` is what any kernel's blocks may plan to use on a
generation. ``sublane_multiple`` is the TPU tiling rule behind all three (the
second-to-last block dimension is a multiple of it, or the whole array dimension), and
``compiler_params`` builds Mosaic's parameters from the grid's dimension semantics.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

SCOPED_VMEM_BYTES = {"v4": 16 << 20, "v5p": 64 << 20, "v5e": 128 << 20, "v6e": 128 << 20}
"""Mosaic's default scoped VMEM limit per TPU generation."""


def vmem_budget(generation: str | None = None, *, reserve: int, cap: int | None = None) -> int:
    """VMEM a kernel's blocks may plan to use: the generation's default scoped VMEM less
    ``reserve`` bytes left for Mosaic's own scratch, at most ``cap``. Without a known generation,
    the smallest one's, so the blocks fit every generation."""
    scoped = SCOPED_VMEM_BYTES.get(generation or "", min(SCOPED_VMEM_BYTES.values()))
    budget = scoped - reserve
    return budget if cap is None else min(cap, budget)


VMEM_BUDGET_BYTES = vmem_budget(reserve=8 << 20)
"""Half of v4's 16 MiB default scoped VMEM (the budget of row-blocked kernels): a block that fits
it fits every generation, with room for Mosaic's own scratch."""
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


def row_block_problem(
    rows: int, block_rows: int, dtype: Any, *, name: str = "block_rows", axis: str = "rows"
) -> str | None:
    """Why ``block_rows`` is not a legal row block for ``rows`` rows of ``dtype``, or None;
    ``name`` and ``axis`` are what the kernel calls the block and the rows (``block_tokens``,
    ``tokens``)."""
    multiple = sublane_multiple(dtype)
    if block_rows == rows or (block_rows > 0 and block_rows % multiple == 0):
        return None
    return f"{name}={block_rows} must equal {axis} ({rows}) or be a multiple of {multiple}"


def chunk_problem(chunk: int) -> str | None:
    """Why ``chunk`` tokens cannot be the row block of a chunked scan (gated delta rule, Mamba-2),
    or None: a positive multiple of 16 (the 16-bit sublane tile, so one chunk size serves f32
    and bf16)."""
    if chunk > 0 and chunk % sublane_multiple(jnp.bfloat16) == 0:
        return None
    return f"chunk={chunk} must be a positive multiple of {sublane_multiple(jnp.bfloat16)}"


def compiler_params(*semantics: str, vmem_limit_bytes: int | None = None) -> Any:
    """``pltpu.CompilerParams`` for a grid with these dimension semantics (``"parallel"``: steps
    are independent and may be split across TensorCores; ``"arbitrary"``: sequential, e.g. an
    accumulation axis), optionally raising the scoped VMEM limit."""
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.CompilerParams(dimension_semantics=semantics, vmem_limit_bytes=vmem_limit_bytes)
