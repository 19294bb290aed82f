"""Quantized expert weights: the formats, quantizers and the dequantization every path shares.

``int8``: symmetric per output channel. ``weight`` int8 [E, out, in], ``scale`` f32 [E, out];
``w = weight * scale``.

``w8a8``: int8's weights, and activations quantized at run time per token and 128-column group
of the contraction, symmetric (``quantize_rows``; DeepSeek-V3's 1 x 128 activation tiles): a
blocked kernel never holds a whole row of the intermediate activation. int8 x int8 products
accumulate in int32 per group, then the group's activation scale and the weight's channel scale
multiply. Needs H and I to be multiples of 128.

``fp8``: e4m3 with one f32 scale per 128 x 128 block, Transformers' ``FineGrainedFP8`` layout
(DeepSeek-V3 / Qwen3 FP8 checkpoints). ``weight`` float8_e4m3fn [E, out, in], ``scale`` f32
[E, ceil(out / 128), ceil(in / 128)] (Transformers names it ``*_scale_inv``; it multiplies);
``w = weight * scale[block]``.

``mxfp4``: OCP MX fp4 (e2m1) in Transformers' GPT-OSS checkpoint layout: ``weight`` uint8
[E, out, in / 2], two values per byte along ``in`` (low nibble first; the checkpoint's
``*_blocks`` [E, out, in / 32, 16] is a view of it), ``scale`` uint8 [E, out, in / 32]: one e8m0
exponent per 32 values (Transformers' ``*_scales``); ``w = fp4(nibble) * 2 ** (scale - 127)``.
The scales may carry trailing groups past the weight's bytes (lane padding, stored as 0); no
value uses them (exponent 255, inf, would give NaN in the kernel's 0/1 expansion).

All use Transformers' [E, out, in] expert layout. int8 and fp8 are the kernel API's shared
``weight_formats`` (their scale shapes and dequantization are defined there, as moe-gemm reads
them); this module adds mxfp4 and w8a8. The kernel reads the scales in its own layout
(``kernel_scale``); the XLA path and the tests dequantize with ``dequantize``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernel_hub.kernel_api import weight_formats

KINDS = ("int8", "fp8", "mxfp4", "w8a8")
FP8_BLOCK = weight_formats.FP8_BLOCK
FP8_MAX = 448.0  # largest finite float8_e4m3fn
INT8_MAX = 127.0
WEIGHT_DTYPES = {**weight_formats.WEIGHT_DTYPES, "mxfp4": jnp.uint8, "w8a8": jnp.int8}
SCALE_DTYPES = {"int8": jnp.float32, "fp8": jnp.float32, "mxfp4": jnp.uint8, "w8a8": jnp.float32}
MX_GROUP = 32
"""mxfp4 values per scale."""
E8M0_BIAS = 127


def weight_format(kind: str) -> str:
    """The weight format of a quantization kind (w8a8 stores int8's)."""
    return "int8" if kind == "w8a8" else kind


ACT_GROUP = 128
"""w8a8: activation columns per scale."""


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(int8 [rows, n], f32 scale [rows, n / 128]) of ``x``: symmetric per row and 128-column
    group, round to nearest; an all-zero group gets scale 1. Runs in a Mosaic kernel too."""
    x = x.astype(jnp.float32)
    parts, scales = [], []
    for g in range(x.shape[1] // ACT_GROUP):
        part = x[:, g * ACT_GROUP : (g + 1) * ACT_GROUP]
        amax = jnp.max(jnp.abs(part), axis=1, keepdims=True)
        scale = jnp.where(amax > 0, amax / INT8_MAX, 1.0)
        parts.append(jnp.clip(jnp.round(part / scale), -INT8_MAX, INT8_MAX).astype(jnp.int8))
        scales.append(scale)
    return jnp.concatenate(parts, axis=1), jnp.concatenate(scales, axis=1)


def scale_shape(kind: str, weight_shape: tuple[int, ...]) -> tuple[int, ...]:
    kind = weight_format(kind)
    if kind == "mxfp4":  # inner is the packed axis: two values per byte
        experts, out, inner = weight_shape
        return (experts, out, 2 * inner // MX_GROUP)
    return weight_formats.scale_shape(kind, weight_shape)


def fp4_values(code: jax.Array) -> jax.Array:
    """f32 e2m1 value of each 4-bit code (int32 in [0, 16)): sign, 2 exponent bits, 1 mantissa
    bit; exponent 0 is subnormal (0 or 0.5). Arithmetic, so it runs in a Mosaic kernel too."""
    mag, mantissa = code & 7, (code & 1).astype(jnp.float32)
    exponent = mag >> 1
    power = jnp.left_shift(1, jnp.maximum(exponent - 1, 0)).astype(jnp.float32)
    value = jnp.where(exponent == 0, 0.5 * mantissa, (1.0 + 0.5 * mantissa) * power)
    return jnp.where(code >= 8, -value, value)


def e8m0_values(exponent: jax.Array) -> jax.Array:
    """f32 ``2 ** (e - 127)`` of int32 exponents in [0, 256): the float with those exponent
    bits (255 is inf, as ``ldexp`` gives). e = 0 gives 0 where ``ldexp`` gives 2 ** -127: XLA
    and TPUs flush such subnormal products to zero anyway (values below 1.2e-38)."""
    return jax.lax.bitcast_convert_type(jnp.left_shift(exponent, 23), jnp.float32)


def unpack_fp4(weight: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(values at even, values at odd contraction positions), f32, of packed bytes (uint8 or
    their int8 view)."""
    byte = weight.astype(jnp.int32) & 0xFF
    return fp4_values(byte & 0xF), fp4_values(byte >> 4)


def _dequantize_mxfp4(weight: jax.Array, scale: jax.Array) -> jax.Array:
    low, high = unpack_fp4(weight)
    values = jnp.stack([low, high], axis=-1).reshape(*weight.shape[:-1], 2 * weight.shape[-1])
    factor = jnp.repeat(e8m0_values(scale.astype(jnp.int32)), MX_GROUP, axis=-1)
    return values * factor[..., : values.shape[-1]]  # trailing (padding) groups unread


def dequantize(weight: jax.Array, scale: jax.Array, kind: str, dtype) -> jax.Array:
    """``weight * scale`` rounded once to ``dtype``: int8 and fp8 as ``weight_formats`` defines
    them; mxfp4 values times powers of two are exact in every float dtype."""
    kind = weight_format(kind)
    if kind == "mxfp4":
        return _dequantize_mxfp4(weight, scale).astype(dtype)
    return weight_formats.dequantize(weight, scale, kind, dtype)


def quantize(weight: jax.Array, kind: str) -> tuple[jax.Array, jax.Array]:
    """(quantized weight, scale) of an [E, out, in] float weight; round to nearest (int8, fp8:
    mxfp4 weights come from checkpoints or ``quantize_experts``)."""
    kind = weight_format(kind)
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
    full = jnp.repeat(jnp.repeat(scale, FP8_BLOCK, axis=1), FP8_BLOCK, axis=2)
    q = (w / full[:, :out, :inner]).astype(jnp.float8_e4m3fn)
    return q, scale


def kernel_scale(scale: jax.Array, kind: str) -> jax.Array:
    """The scale as the kernel reads it: int8 [E, 1, out]; fp8 and mxfp4 as stored (the kernel
    picks and expands each step's blocks in VMEM, so no per-call expansion over all experts)."""
    kind = weight_format(kind)
    if kind == "int8":
        return scale.astype(jnp.float32)[:, None, :]
    return scale
