"""Plain JAX quantized matmul: the numerics oracle and the XLA implementation.

What a quantized weight stands for is ``kernel_api.weight_formats``'s dequantize (``weight *
scale`` in f32, rounded once to the activation dtype, Transformers' order); the product
accumulates in f32 (f64 for f64 activations) and is rounded once to the output dtype. int8 and
fp8 weights are [out, in]; int4 weights are GPTQ-packed [in / 8, out], dequantized to [in, out]
with their group zero points (``zeros``; None: the symmetric 8).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernel_hub.kernel_api import weight_formats

from . import int4


def dequantize(weight: jax.Array, scale: jax.Array, fmt: str, dtype,
               zeros: jax.Array | None = None) -> jax.Array:  # fmt: skip
    """The weight a quantized ``weight`` and its ``scale`` (int4: and ``zeros``) stand for, in
    ``dtype``: [out, in] for int8 and fp8, [in, out] for int4 (its stored orientation)."""
    if fmt == "int4":
        return int4.dequantize(weight, scale, dtype, zeros)
    return weight_formats.dequantize(weight[None], scale[None], fmt, dtype)[0]


def _in_axis(fmt: str) -> int:
    """The dequantized weight's ``in`` axis."""
    return 0 if fmt == "int4" else 1


def quantized_matmul(x: jax.Array, weight: jax.Array, scale: jax.Array, fmt: str, out_dtype,
                     zeros: jax.Array | None = None):  # fmt: skip
    """``x [m, in] @ W`` with ``W = dequantize(weight, scale, zeros)`` in x's dtype -> [m, out]."""
    acc = jnp.promote_types(x.dtype, jnp.float32)
    w = dequantize(weight, scale, fmt, x.dtype, zeros)
    y = jax.lax.dot_general(
        x,
        w,
        (((1,), (_in_axis(fmt),)), ((), ())),
        precision=jax.lax.Precision.HIGHEST,
        preferred_element_type=acc,
    )
    return y.astype(out_dtype)


def input_gradient(weight: jax.Array, scale: jax.Array, fmt: str, dout: jax.Array, dtype,
                   zeros: jax.Array | None = None):  # fmt: skip
    """``d x = d out @ W`` [m, in] in ``dtype``: the activations' gradient, through the whole
    dequantized weight (a temporary the size of the weight in ``dtype``)."""
    acc = jnp.promote_types(dtype, jnp.float32)
    w = dequantize(weight, scale, fmt, dtype, zeros)
    dx = jax.lax.dot_general(
        dout.astype(dtype),
        w,
        (((1,), (1 - _in_axis(fmt),)), ((), ())),
        precision=jax.lax.Precision.HIGHEST,
        preferred_element_type=acc,
    )
    return dx.astype(dtype)


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Dynamic per-token int8 activations: (int8 [m, k], f32 scale [m, 1]) with each row's
    largest magnitude at 127 (``round(x / scale)``, half to even; an all-zero row has scale 1)."""
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=1, keepdims=True)
    scale = jnp.where(amax > 0, amax / 127, 1.0)
    q = jnp.clip(jnp.round(x.astype(jnp.float32) / scale), -127, 127).astype(jnp.int8)
    return q, scale


def w8a8_matmul(x: jax.Array, weight: jax.Array, scale: jax.Array, out_dtype):
    """W8A8: ``x`` quantized per token, ``int8 x int8 -> int32`` exactly, then rescaled by the
    token's and the output channel's scales in f32 -> [m, out]."""
    q, x_scale = quantize_rows(x)
    acc = jax.lax.dot_general(q, weight, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)
    return (acc.astype(jnp.float32) * x_scale * scale[None, :]).astype(out_dtype)
