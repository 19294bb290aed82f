"""Tile sizes for the Pallas kernels: TPU block rules, VMEM estimate, and a cost model to choose.

``Tiling(tm, tk, tn)`` always means: ``tm`` rows of ``lhs`` (the ragged dimension), ``tk`` of the
contraction for ``gmm`` / of the first output dimension for ``tgmm``, ``tn`` of the last output
dimension. TPU rules: the last two dimensions of every block are multiples of (sublane, 128) or
the whole array dimension. ``gmm`` also needs ``tk`` to divide ``k``: a ragged contraction tile
would add out-of-bounds garbage into valid outputs.

Defaults come from a small cost model: each visit computes a whole ``tm``-row tile however few of
its rows belong to the visited group (``m + (E - 1) * tm`` rows of work in all), every block that
changes between grid steps is copied from HBM, and every grid step has a fixed overhead. The
candidate with the least modelled time whose VMEM estimate fits the budget wins.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import jax.numpy as jnp

from kernel_hub.kernel_api import tiling as tpu_tiling

from .schedule import cdiv

LANES = 128
# Below v4's 16 MiB scoped VMEM default, with room for Mosaic's own scratch.
VMEM_BUDGET_BYTES = 10 * 1024 * 1024
ROW_TILES = (1024, 512, 256, 128, 64, 32, 16, 8)
LANE_TILE_CAP = 2048


@dataclass(frozen=True)
class Tiling:
    """Block sizes of one kernel call (see the module docstring for what each one tiles)."""

    tm: int
    tk: int
    tn: int


@dataclass(frozen=True)
class Machine:
    """Rough throughputs the cost model weighs tilings with."""

    flops_per_us: float
    bytes_per_us: float
    step_us: float


# Order-of-magnitude figures for v4-v6e (bf16 MXU, HBM, Pallas grid-step overhead).
TPU = Machine(flops_per_us=2e8, bytes_per_us=1e6, step_us=0.35)
# Interpret mode (CPU) copies whole blocks every grid step, so few, large steps win: on a 2-core
# CPU (m=512, k=1024, n=4096, E=8) 128-row tiles beat 8, 32, 64 and 512.
INTERPRET_TILE_ROWS = 128


def _dim_problem(name: str, tile: int, size: int, multiple: int) -> str | None:
    if tile == size or (tile > 0 and tile % multiple == 0):
        return None
    return f"{name}={tile} must equal the dimension ({size}) or be a multiple of {multiple}"


def tiling_problem(kind: str, m: int, k: int, n: int, dtype, tiling: Tiling) -> str | None:
    """Why ``tiling`` breaks TPU block rules for ``kind`` ("gmm" or "tgmm"), or None."""
    problems = [
        _dim_problem("tm", tiling.tm, m, tpu_tiling.sublane_multiple(dtype)),
        _dim_problem("tk", tiling.tk, k, LANES),
        _dim_problem("tn", tiling.tn, n, LANES),
    ]
    problems.append(contraction_problem(kind, k, tiling))
    found = [p for p in problems if p]
    return "; ".join(found) or None


def contraction_problem(kind: str, k: int, tiling: Tiling) -> str | None:
    """Why ``tiling`` would give a wrong gmm on any backend, interpret mode included: its last
    contraction block would read past k."""
    if kind == "gmm" and k % tiling.tk:
        return f"tk={tiling.tk} must divide k={k} (the contraction cannot be ragged)"
    return None


def vmem_bytes(kind: str, tiling: Tiling, in_dtype, out_dtype) -> int:
    """Estimated VMEM of one kernel: double-buffered blocks, f32 accumulator, temporaries."""
    tm, tk, tn = tiling.tm, tiling.tk, tiling.tn
    in_bytes = jnp.dtype(in_dtype).itemsize
    out_bytes = jnp.dtype(out_dtype).itemsize
    if kind == "gmm":
        inputs, out = tm * tk + tk * tn, tm * tn
        temporaries = 2 * tm * tn * 4  # dot result and its masked copy
    else:
        inputs, out = tm * tk + tm * tn, tk * tn
        temporaries = (tm * tk + tm * tn) * in_bytes + tk * tn * 4  # masked inputs, dot result
    return 2 * inputs * in_bytes + 2 * out * out_bytes + out * 4 + temporaries


def modelled_us(
    kind: str, m: int, k: int, n: int, groups: int, dtype, tiling: Tiling, machine: Machine
) -> float:
    """Modelled time of one call (see the module docstring)."""
    tm, tk, tn = tiling.tm, tiling.tk, tiling.tn
    visits = cdiv(m, tm) + min(groups, m) - 1
    itemsize = jnp.dtype(dtype).itemsize
    flops = 2 * visits * tm * k * n
    if kind == "gmm":
        steps = cdiv(n, tn) * visits * cdiv(k, tk)
        copied = m * k * cdiv(n, tn) + visits * k * n + m * n
    else:
        steps = cdiv(k, tk) * cdiv(n, tn) * visits
        copied = m * k * cdiv(n, tn) + m * n * cdiv(k, tk) + groups * k * n
    return (
        max(flops / machine.flops_per_us, copied * itemsize / machine.bytes_per_us)
        + steps * machine.step_us
    )


def _row_candidates(m: int, dtype) -> list[int]:
    multiple = tpu_tiling.sublane_multiple(dtype)
    return [m] + [t for t in ROW_TILES if t < m and t % multiple == 0]


def _lane_candidates(size: int, *, divide: bool) -> list[int]:
    tiles = [size] if size <= LANE_TILE_CAP or (divide and size % LANES) else []
    tiles += [
        t for t in range(LANES, min(size, LANE_TILE_CAP + 1), LANES) if not divide or size % t == 0
    ]
    return tiles


def default_tiling(
    kind: str, m: int, k: int, n: int, groups: int, dtype, out_dtype, *, interpret: bool
) -> Tiling:
    """The fitting tiling with the least modelled time; interpret mode keeps ``k``/``n`` whole."""
    if interpret:
        return Tiling(min(m, INTERPRET_TILE_ROWS), k, n)
    legal = [
        Tiling(*tiles)
        for tiles in itertools.product(
            _row_candidates(m, dtype),
            _lane_candidates(k, divide=kind == "gmm"),
            _lane_candidates(n, divide=False),
        )
    ]
    fitting = [t for t in legal if vmem_bytes(kind, t, dtype, out_dtype) <= VMEM_BUDGET_BYTES]
    if not fitting:  # nothing fits the estimate: the smallest blocks, the compiler decides
        return min(legal, key=lambda t: vmem_bytes(kind, t, dtype, out_dtype))
    return min(
        fitting,
        key=lambda t: (modelled_us(kind, m, k, n, groups, dtype, t, TPU), -t.tm * t.tk * t.tn),
    )
