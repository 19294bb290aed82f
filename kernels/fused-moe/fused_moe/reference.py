"""The XLA implementation: expert rows sorted and copied, two ``ragged_dot``s, the activation
and the weighted combine as separate XLA ops; quantized weights dequantized whole first.

Accumulation is f32 (f64 for f64 inputs); the activation runs on the f32 projections and is
rounded to the compute dtype before the down projection, as in the Pallas kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import quant
from .config import ExpertsConfig


def accumulator(dtype) -> jnp.dtype:
    return jnp.promote_types(dtype, jnp.float32)


def _dims(transposed: bool) -> jax.lax.RaggedDotDimensionNumbers:
    return jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([1], [1 if transposed else 2]), ([], [])),
        lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[0],
    )


def weights(w, scale, config: ExpertsConfig, dtype):
    """The weight in the compute dtype (quantized weights dequantized; w8a8's int8 values as
    f32, their scale applied after the product)."""
    if config.quantization is None:
        return w
    if config.quantization == "w8a8":
        return w.astype(jnp.float32)
    return quant.dequantize(w, scale, config.quantization, dtype)


def _ragged(rows, w, scale, sizes, sorted_expert, config: ExpertsConfig, precision, acc):
    """Each row times its expert's weight, in ``acc``; w8a8 quantizes the rows per token and 128
    columns, multiplies the integer weights by the dequantized rows (each group's sum is its
    int32 product times its scale, up to f32 rounding) and applies the weight scale."""
    dims = _dims(config.transposed)
    if config.quantization != "w8a8":
        return jax.lax.ragged_dot_general(
            rows, w, sizes, dims, precision=precision, preferred_element_type=acc
        )
    q, row_scale = quant.quantize_rows(rows)
    rows = q.astype(jnp.float32) * jnp.repeat(row_scale, quant.ACT_GROUP, axis=1)
    product = jax.lax.ragged_dot_general(
        rows, w, sizes, dims, precision=jax.lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )  # fmt: skip
    return (product * scale[sorted_expert]).astype(acc)


def split_gate_up(h: jax.Array, interleaved: bool) -> tuple[jax.Array, jax.Array]:
    if interleaved:
        return h[:, 0::2], h[:, 1::2]
    half = h.shape[1] // 2
    return h[:, :half], h[:, half:]


def fused_experts(
    x,
    top_k_index,
    top_k_weights,
    w_gate_up,
    w_down,
    gate_up_bias,
    down_bias,
    gate_up_scale,
    down_scale,
    *,
    config: ExpertsConfig,
    out_dtype,
):
    """sum over slots s of ``w[t, s] * expert_{e[t, s]}(x[t])``; ids outside [0, E) add 0."""
    tokens, top_k = top_k_index.shape
    num_experts = w_gate_up.shape[0]
    acc = accumulator(x.dtype)
    # Full precision for f32/f64 operands; TPU's ragged_dot kernel rejects it for bf16.
    precision = jax.lax.Precision.HIGHEST if jnp.dtype(x.dtype).itemsize >= 4 else None
    w1 = weights(w_gate_up, gate_up_scale, config, x.dtype)
    w2 = weights(w_down, down_scale, config, x.dtype)

    flat = top_k_index.reshape(-1)
    valid = (flat >= 0) & (flat < num_experts)
    expert = jnp.where(valid, flat, num_experts)
    order = jnp.argsort(expert, stable=True)
    sorted_expert = jnp.minimum(expert[order], num_experts - 1)
    sorted_valid = valid[order]
    sizes = jnp.bincount(expert, length=num_experts + 1)[:num_experts].astype(jnp.int32)
    rows = x[order // top_k]

    h = _ragged(rows, w1, gate_up_scale, sizes, sorted_expert, config, precision, acc)
    if gate_up_bias is not None:
        h = h + gate_up_bias[sorted_expert].astype(acc)
    gate, up = split_gate_up(h, config.interleaved)
    act = config.activation(gate, up)
    if config.quantization != "w8a8":  # w8a8 quantizes the f32 activation itself
        act = act.astype(x.dtype)
    y = _ragged(act, w2, down_scale, sizes, sorted_expert, config, precision, acc)
    if down_bias is not None:
        y = y + down_bias[sorted_expert].astype(acc)
    weight = jnp.where(sorted_valid, top_k_weights.reshape(-1)[order].astype(acc), 0)
    y = y * weight[:, None]
    out = jax.ops.segment_sum(y, order // top_k, num_segments=tokens)
    return out.astype(out_dtype)
