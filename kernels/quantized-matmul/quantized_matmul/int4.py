"""int4 group-wise weights in GPTQ's packing, what quantized_matmul_int4 reads.

``qweight`` int32 [in / 8, out], eight 4-bit values per word along ``in`` (value j of word r,
bits 4j..4j+3, is input row 8r + j); ``scale`` f32 [in / 128, out], one per group of 128 input
rows and output column; ``zeros`` int32 [in / 128, out] (values 0..15, one per group and output
column, the zero points as they are subtracted) or None for the symmetric zero point 8:
``w[in, out] = (nibble - zero[in // 128, out]) * scale[in // 128, out]`` (GPTQ's ``sym=False``
and AWQ hold per-group zeros; ``sym=True`` the constant 8, stored as 7 in GPTQ's original format,
which adds 1: the loader resolves that offset, this layout holds the zero point subtracted).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

GROUP = 128
PER_WORD = 8
ZERO = 8


def scale_shape(packed_shape: tuple[int, int]) -> tuple[int, int]:
    """The scale (and zeros) shape of a GPTQ-packed [in / 8, out] int4 weight."""
    rows, out = packed_shape
    return (-(-rows * PER_WORD // GROUP), out)


def unpack(qweight: jax.Array) -> jax.Array:
    """The [in, out] int32 nibbles (0..15) of a GPTQ-packed [in / 8, out] weight."""
    rows, out = qweight.shape
    shifts = (4 * jnp.arange(PER_WORD, dtype=jnp.int32))[None, :, None]
    nibbles = (qweight[:, None, :] >> shifts) & 0xF
    return nibbles.reshape(rows * PER_WORD, out)


def dequantize(qweight: jax.Array, scale: jax.Array, dtype, zeros: jax.Array | None = None):
    """The [in, out] weight a GPTQ-packed int4 ``qweight``, its group ``scale`` and ``zeros``
    stand for: ``(nibble - zero) * scale`` in f32 (f64 for f64), rounded once to ``dtype``."""
    acc = jnp.promote_types(dtype, jnp.float32)
    rows = qweight.shape[0] * PER_WORD
    zero = ZERO if zeros is None else jnp.repeat(zeros, GROUP, axis=0)[:rows]
    values = unpack(qweight) - zero
    full = jnp.repeat(scale.astype(acc), GROUP, axis=0)[:rows]
    return (values.astype(acc) * full).astype(dtype)
