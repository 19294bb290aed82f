"""Quantized expert weights: the formats, quantizers and the dequantization every path shares.

``int8``: symmetric per output channel. ``weight`` int8 [E, out, in], ``scale`` f32 [E, out];
``w = weight * scale``.

``fp8``: e4m3 with one f32 scale per 128 x 128 block, Transformers' ``FineGrainedFP8`` layout
(DeepSeek-V3 / Qwen3 FP8 checkpoints). ``weight`` float8_e4m3fn [E, out, in], ``scale`` f32
[E, ceil(out / 128), ceil(in / 128)] (Transformers names it ``*_scale_inv``; it multiplies);
``w = weight * scale[block]``.

Both use Transformers' [E, out, in] expert layout. The kernel reads the scales in its own layout
(``kernel_scale``); the XLA path and the tests dequantize with ``dequantize``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

KINDS = ("int8", "fp8")
FP8_BLOCK = 128
FP8_MAX = 448.0  # largest finite float8_e4m3fn
INT8_MAX = 127.0
WEIGHT_DTYPES = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}


def scale_shape(kind: str, weight_shape: tuple[int, ...]) -> tuple[int, ...]:
    experts, out, inner = weight_shape
    if kind == "int8":
        return (experts, out)
    return (experts, -(-out // FP8_BLOCK), -(-inner // FP8_BLOCK))


def _expand(scale: jax.Array, kind: str, shape: tuple[int, ...]) -> jax.Array:
    """The scale of every weight element, [E, out, in] f32."""
    _, out, inner = shape
    if kind == "int8":
        return jnp.broadcast_to(scale[:, :, None], shape)
    full = jnp.repeat(jnp.repeat(scale, FP8_BLOCK, axis=1), FP8_BLOCK, axis=2)
    return full[:, :out, :inner]


def dequantize(weight: jax.Array, scale: jax.Array, kind: str, dtype) -> jax.Array:
    """``weight * scale`` in f32, rounded once to ``dtype`` (Transformers' dequantize order)."""
    full = _expand(scale.astype(jnp.float32), kind, weight.shape)
    return (weight.astype(jnp.float32) * full).astype(dtype)


def quantize(weight: jax.Array, kind: str) -> tuple[jax.Array, jax.Array]:
    """(quantized weight, scale) of an [E, out, in] float weight; round to nearest."""
    w = weight.astype(jnp.float32)
    if kind == "int8":
        amax = jnp.max(jnp.abs(w), axis=2)
        scale = jnp.where(amax > 0, amax / INT8_MAX, 1.0)
        q = jnp.clip(jnp.round(w / scale[:, :, None]), -INT8_MAX, INT8_MAX)
        return q.astype(jnp.int8), scale
    experts, out, inner = w.shape
    rows, cols = -(-out // FP8_BLOCK), -(-inner // FP8_BLOCK)
    padded = jnp.pad(w, ((0, 0), (0, rows * FP8_BLOCK - out), (0, cols * FP8_BLOCK - inner)))
    tiles = padded.reshape(experts, rows, FP8_BLOCK, cols, FP8_BLOCK)
    amax = jnp.max(jnp.abs(tiles), axis=(2, 4))
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    q = (w / _expand(scale, kind, w.shape)).astype(jnp.float8_e4m3fn)
    return q, scale


def kernel_scale(scale: jax.Array, kind: str, out: int) -> jax.Array:
    """The scale as the kernel reads it: int8 [E, 1, out]; fp8 [E, ceil(in / 128), out] (each
    block's scale repeated over its 128 output rows, laid along lanes: 1/32 of the fp8 weight's
    bytes), so a 128-wide slice of the contraction scales whole output rows at once."""
    scale = scale.astype(jnp.float32)
    if kind == "int8":
        return scale[:, None, :]
    return jnp.repeat(scale, FP8_BLOCK, axis=1)[:, :out, :].transpose(0, 2, 1)
