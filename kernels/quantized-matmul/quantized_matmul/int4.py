"""int4 group-wise weights in GPTQ's packing, what quantized_matmul_int4 reads.

``qweight`` int32 [in / 8, out], eight 4-bit values per word along ``in`` (value j of word r,
bits 4j..4j+3, is input row 8r + j); ``scale`` f32 [in / 128, out], one per group of 128 input
rows and output column; symmetric, zero point 8: ``w[in, out] = (nibble - 8) * scale[in // 128,
out]`` (GPTQ's ``sym=True``; its stored ``qzeros`` are the constant 8, or 7 in the original
format that adds 1).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

GROUP = 128
PER_WORD = 8
ZERO = 8


def scale_shape(packed_shape: tuple[int, int]) -> tuple[int, int]:
    """The scale shape of a GPTQ-packed [in / 8, out] int4 weight."""
    rows, out = packed_shape
    return (-(-rows * PER_WORD // GROUP), out)


def unpack(qweight: jax.Array) -> jax.Array:
    """The [in, out] int32 nibbles (0..15) of a GPTQ-packed [in / 8, out] weight."""
    rows, out = qweight.shape
    shifts = (4 * jnp.arange(PER_WORD, dtype=jnp.int32))[None, :, None]
    nibbles = (qweight[:, None, :] >> shifts) & 0xF
    return nibbles.reshape(rows * PER_WORD, out)


def dequantize(qweight: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """The [in, out] weight a GPTQ-packed int4 ``qweight`` and its group ``scale`` stand for:
    ``(nibble - 8) * scale`` in f32 (f64 for f64), rounded once to ``dtype``."""
    acc = jnp.promote_types(dtype, jnp.float32)
    nibbles = unpack(qweight) - ZERO
    full = jnp.repeat(scale.astype(acc), GROUP, axis=0)[: nibbles.shape[0]]
    return (nibbles.astype(acc) * full).astype(dtype)
