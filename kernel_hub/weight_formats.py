"""Quantized weight formats that kernels share, in Transformers' ``[E, out, in]`` expert layout.

``int8``: symmetric per output channel; ``scale`` f32 [E, out]; ``w = weight * scale``.
``fp8``: e4m3 with one f32 scale per 128 x 128 block (Transformers' ``FineGrainedFP8`` layout of
DeepSeek-V3 / Qwen3 FP8 checkpoints; it calls the scale ``*_scale_inv``, and it multiplies);
``scale`` [E, ceil(out / 128), ceil(in / 128)]; ``w = weight * scale[block]``.

One definition of what a quantized weight stands for (``dequantize``: the XLA paths and the
tests' oracles), and the block scales of one weight block picked in VMEM (``fp8_block_scales``:
what a Pallas kernel multiplies), so kernels reading these formats do not each redefine them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

FORMATS = ("int8", "fp8")
FP8_BLOCK = 128
WEIGHT_DTYPES = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}


def scale_shape(fmt: str, weight_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The scale shape of an [E, out, in] weight in format ``fmt``."""
    experts, out, inner = weight_shape
    if fmt == "int8":
        return (experts, out)
    return (experts, -(-out // FP8_BLOCK), -(-inner // FP8_BLOCK))


def dequantize(weight: jax.Array, scale: jax.Array, fmt: str, dtype) -> jax.Array:
    """``weight * scale`` in f32 (f64 for an f64 ``dtype``), rounded once to ``dtype``
    (Transformers' dequantize order)."""
    acc = jnp.promote_types(dtype, jnp.float32)
    scale = scale.astype(acc)
    _, out, inner = weight.shape
    if fmt == "int8":
        full = scale[:, :, None]
    else:
        full = jnp.repeat(jnp.repeat(scale, FP8_BLOCK, axis=1), FP8_BLOCK, axis=2)
        full = full[:, :out, :inner]
    return (weight.astype(acc) * full).astype(dtype)


def _pick(size: int, first, count: int, *, rows: bool) -> jax.Array:
    """0/1 [count, size] (``rows``) or [size, count] matrix selecting ``count`` consecutive
    entries from ``first``."""
    shape = (count, size) if rows else (size, count)
    iota = jax.lax.broadcasted_iota
    picked = iota(jnp.int32, shape, 0 if rows else 1)
    index = iota(jnp.int32, shape, 1 if rows else 0)
    return (index == first + picked).astype(jnp.float32)


def fp8_block_scales(
    scale: jax.Array, out_first, out_blocks: int, in_first, in_blocks: int, *, contract_out: bool
) -> jax.Array:
    """The 128 x 128 block scales of one weight block, from one expert's ``scale``
    [out / 128, in / 128], as one row per contraction slice of 128: [in_blocks, 128 * out_blocks]
    when the matmul contracts ``in`` (each scale repeated over its 128 output rows), or
    [out_blocks, 128 * in_blocks] when it contracts ``out`` (``contract_out``). The block starts
    at output block ``out_first`` and input block ``in_first`` (traced values allowed).

    Picked and expanded with exact 0/1 matmuls (f32 at full precision), so it runs in a Mosaic
    kernel without dynamic slicing of small arrays.
    """
    rows, cols = scale.shape
    full = jax.lax.Precision.HIGHEST
    f32 = jnp.float32
    picked = jnp.dot(_pick(rows, out_first, out_blocks, rows=True), scale.astype(f32),
                     precision=full, preferred_element_type=f32)  # fmt: skip
    picked = jnp.dot(picked, _pick(cols, in_first, in_blocks, rows=False), precision=full,
                     preferred_element_type=f32)  # [out_blocks, in_blocks]  # fmt: skip
    blocks = in_blocks if contract_out else out_blocks
    width = blocks * FP8_BLOCK
    iota = jax.lax.broadcasted_iota
    expand = (iota(jnp.int32, (blocks, width), 1) // FP8_BLOCK
              == iota(jnp.int32, (blocks, width), 0)).astype(f32)  # fmt: skip
    contract = ((1,), (0,)) if contract_out else ((0,), (0,))
    return jax.lax.dot_general(
        picked, expand, (contract, ((), ())), precision=full, preferred_element_type=f32
    )
