"""Block sizes of the fused kernel: ``tm`` rows of one expert per chunk, ``ti`` columns of the
intermediate dimension per grid step. TPU block rules per weight layout, and the defaults.

The kernel keeps ``hidden_states``, the f32 output accumulator and two per-expert scratch
buffers (gathered rows, f32 down-projection partials) whole in VMEM, so it serves up to
``MAX_TOKENS`` tokens per call; ``api`` sends longer calls (prefill) to the XLA path.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp

from .config import ExpertsConfig
from .quant import FP8_BLOCK

LANES = 128
MAX_TOKENS = 512
"""Tokens per kernel call: the largest decode bucket of continuous batching."""
TARGET_TI = 512
"""Intermediate columns per step: three [ti, H] weight blocks, double-buffered, stay below
~30 MiB for H = 7168 in bf16."""
MAX_TM = 128
MIB = 1024 * 1024
VMEM_BYTES = {"v4": 16 * MIB, "v5p": 95 * MIB}
"""VMEM per core where it is not 128 MiB (v5e, v6e)."""
DEFAULT_VMEM_BYTES = 128 * MIB


def lane_padded(
    hidden: int, inter: int, *, transposed: bool, interleaved: bool, packing: int = 1
) -> tuple[int, int]:
    """(H, I) padded so no weight axis on lanes is ragged (``padding`` pads the weights to these
    sizes once): H to a multiple of 128 stored elements (``packing`` values each: mxfp4's bytes
    hold two); I where it is on lanes (2I of [E, H, 2I], I of [E, H, I]) and gate/up are
    interleaved (zero pairs at the end keep the stock weights a view of the padded ones; stacked
    [gate; up] padded per half would not)."""
    lanes = LANES * packing
    up = lambda n, m: -(-n // m) * m
    minor = 2 * inter if transposed else inter
    padded_minor = up(minor, lanes) if interleaved else minor
    return up(hidden, lanes), padded_minor // 2 if transposed else padded_minor


def vmem_capacity(generation: str | None) -> int:
    """VMEM of a TPU generation (128 MiB if unknown: interpret mode, newer chips)."""
    return VMEM_BYTES.get(generation or "", DEFAULT_VMEM_BYTES)


def vmem_bytes(
    tokens: int, hidden: int, blocks: Blocks, dtype, w_itemsize: int, quantization: str | None
) -> int:
    """Estimated VMEM: x and the f32 output whole, per-expert scratch, double-buffered weight
    blocks, dequantized weight blocks, and per-chunk temporaries."""
    itemsize = jnp.dtype(dtype).itemsize
    cap = -(-tokens // blocks.tm) * blocks.tm
    resident = tokens * hidden * (2 * itemsize + 4 + 2 * itemsize)  # x (x2), out acc, out (x2)
    scratch = cap * hidden * (itemsize + 4)
    packing = 2 if quantization == "mxfp4" else 1
    weights = 2 * 3 * blocks.ti * hidden * w_itemsize // packing
    dequantized = 2 * blocks.ti * hidden * itemsize if quantization else 0
    if quantization == "mxfp4":  # f32 decoded nibbles and expanded scales of the gate/up block
        dequantized += 2 * blocks.ti * hidden * 4
    temporaries = blocks.tm * (tokens * 4 + 4 * blocks.ti * 4 + 2 * hidden * 4)
    return resident + scratch + weights + dequantized + temporaries


@dataclass(frozen=True)
class Blocks:
    """``tm``: rows per chunk (a multiple of the sublane tile); ``ti``: intermediate columns per
    grid step (divides the intermediate size)."""

    tm: int
    ti: int


def sublanes(dtype) -> int:
    """Rows in one TPU vreg tile: 8 for 32-bit, 16 for 16-bit types."""
    return 8 * max(1, 4 // jnp.dtype(dtype).itemsize)


def ti_problem(ti: int, intermediate: int, config: ExpertsConfig) -> str | None:
    """Why ``ti`` breaks a TPU block rule for this layout, or None."""
    if ti <= 0 or intermediate % ti:
        return f"ti={ti} must divide the intermediate size {intermediate}"
    whole = ti == intermediate
    if config.interleaved:
        # gate/up blocks are 2*ti wide, on lanes when transposed ([E, H, 2I]), else on sublanes
        if config.transposed and not (whole or (2 * ti) % LANES == 0):
            return f"2*ti={2 * ti} must be a multiple of {LANES} (interleaved [E, H, 2I] weights)"
    elif config.transposed and ti % LANES:
        return f"ti={ti} must be a multiple of {LANES} ([E, H, 2I] gate/up weights)"
    elif not config.transposed and ti % 8:
        return f"ti={ti} must be a multiple of 8 ([E, 2I, H] gate/up weights)"
    # down weights: [E, H, I] blocks ti on lanes, [E, I, H] blocks ti on sublanes
    if not config.transposed and not (whole or ti % LANES == 0):
        return f"ti={ti} must be a multiple of {LANES} or the whole intermediate size ([E, H, I])"
    if config.transposed and not (whole or ti % 8 == 0):
        return f"ti={ti} must be a multiple of 8 or the whole intermediate size ([E, I, H])"
    if config.quantization == "mxfp4" and not (whole or (ti // 2) % LANES == 0):
        return f"ti={ti} must be a multiple of {2 * LANES} or the whole intermediate size (mxfp4)"
    if config.quantization == "w8a8" and ti % LANES:
        return f"ti={ti} must be a multiple of {LANES} (w8a8 quantizes 128-column groups)"
    if config.quantization == "fp8" and ti % FP8_BLOCK:
        return f"ti={ti} must be a multiple of {FP8_BLOCK} (fp8 scale blocks)"
    return None


def blocks_problem(blocks: Blocks, intermediate: int, dtype, config: ExpertsConfig) -> str | None:
    if blocks.tm <= 0 or blocks.tm % sublanes(dtype):
        return f"tm={blocks.tm} must be a positive multiple of {sublanes(dtype)} for {dtype}"
    return ti_problem(blocks.ti, intermediate, config)


def default_blocks(
    tokens: int,
    top_k: int,
    num_experts: int,
    intermediate: int,
    hidden: int,
    dtype,
    config: ExpertsConfig,
    w_itemsize: int,
    vmem_budget: int = DEFAULT_VMEM_BYTES,
) -> Blocks | None:
    """Chunks sized to the expected rows per expert; the largest legal ``ti`` <= ``TARGET_TI``
    whose VMEM estimate fits ``vmem_budget`` (else the smallest legal one, and the compiler
    decides; for mxfp4, whose decoded blocks are large, none). None when no ``ti`` is legal."""
    sub = sublanes(dtype)
    expected = -(-tokens * top_k // num_experts)
    tm = sub
    while tm < min(expected, MAX_TM):
        tm *= 2
    divisors = [t for t in range(intermediate, 0, -1) if intermediate % t == 0]
    legal = [t for t in divisors if ti_problem(t, intermediate, config) is None]
    if not legal:
        return None
    q = config.quantization
    fits = [
        t
        for t in legal
        if vmem_bytes(tokens, hidden, Blocks(tm, t), dtype, w_itemsize, q) <= vmem_budget
    ]
    fitting = [t for t in fits if t <= TARGET_TI]
    if q == "mxfp4":
        return Blocks(tm, (fitting or fits)[0]) if fits else None
    return Blocks(tm, fitting[0] if fitting else legal[-1])
