"""Public JAX API: ``quantized_matmul`` (a linear layer's ``x @ W^T`` with W kept quantized), its
implementation table (pallas, xla), input checks and the activations' gradient."""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from kernel_hub.kernel_api import (
    Einsum,
    RowBuckets,
    check_dtype,
    check_rank,
    dtype_name,
    float64_problem,
    jax_default_device,
    jax_platform,
    op,
    pallas_and_xla,
    require,
    tpu_generation,
    weight_formats,
)

from . import pallas_tpu, reference

OP = "quantized_matmul"
FORMATS = {"int8": "int8", "float8_e4m3fn": "fp8"}
"""Stored weight dtype -> its format (``kernel_api.weight_formats``)."""
ACTIVATION_DTYPES = ("float32", "bfloat16", "float64")
__all__ = ["TABLE", "BlockSizes", "quantized_matmul"]
BlockSizes = pallas_tpu.BlockSizes


def weight_format(weight) -> str:
    """The format of a quantized weight, from its dtype (JAX/numpy or torch)."""
    return FORMATS[dtype_name(weight.dtype)]


def scale_shape(fmt: str, out: int, inner: int) -> tuple[int, ...]:
    """The stored scale shape of an [out, in] weight: int8 one per output channel, fp8 one per
    128 x 128 block (the last ones ragged)."""
    return weight_formats.scale_shape(fmt, (1, out, inner))[1:]


def check_inputs(x, weight, scale) -> None:
    """Shape and dtype rules shared by the JAX function and the torch op."""
    check_rank(OP, "x", x, (1, 8))
    check_rank(OP, "weight", weight, 2)
    check_dtype(OP, "x", x, ACTIVATION_DTYPES)
    check_dtype(OP, "weight", weight, tuple(FORMATS))
    check_dtype(OP, "scale", scale, ("float32",))
    out, inner = weight.shape
    require(
        x.shape[-1] == inner,
        f"{OP}: x {tuple(x.shape)} has {x.shape[-1]} features but weight {tuple(weight.shape)} "
        f"([out, in], a Linear's layout) takes {inner}",
    )
    fmt = weight_format(weight)
    expected = scale_shape(fmt, out, inner)
    require(
        tuple(scale.shape) == expected,
        f"{OP}: {fmt} weight {tuple(weight.shape)} needs scale of shape {expected} "
        f"({'one per output channel' if fmt == 'int8' else 'one per 128x128 block'}), got "
        f"{tuple(scale.shape)}",
    )


def _generation() -> str | None:
    device = jax_default_device()
    return tpu_generation(device) if jax_platform() == "tpu" else None


def _blocks(x, weight, block_sizes: BlockSizes | None) -> BlockSizes:
    if block_sizes is not None:
        return block_sizes
    (m, k), n = x.shape, weight.shape[0]
    if jax_platform() == "cpu":  # interpret mode: the grid is a loop, one step is fastest
        return BlockSizes(m, n, k)
    return pallas_tpu.default_block_sizes(m, n, k, x.dtype, _generation())


def _pallas(x, weight, scale, *, out_dtype, block_sizes):
    return pallas_tpu.quantized_matmul(
        x,
        weight,
        scale,
        fmt=weight_format(weight),
        out_dtype=out_dtype,
        blocks=_blocks(x, weight, block_sizes),
        interpret=jax_platform() == "cpu",
    )


def _pallas_problem(x, weight, scale, *, out_dtype, block_sizes):
    if problem := float64_problem(x):
        return problem
    if block_sizes is None:
        return None
    (m, k), n = x.shape, weight.shape[0]
    return pallas_tpu.block_problem(m, n, k, x.dtype, block_sizes)


def _xla(x, weight, scale, *, out_dtype, block_sizes):
    return reference.quantized_matmul(x, weight, scale, weight_format(weight), out_dtype)


TABLE = pallas_and_xla(OP, _pallas, _xla, _pallas_problem)


def _out_dtype(dtype, preferred_element_type) -> jnp.dtype:
    """The result dtype; ``preferred_element_type`` may be a JAX, numpy or torch dtype (the
    torch op passes its argument through)."""
    if preferred_element_type is None:
        return jnp.dtype(dtype)
    try:
        out = jnp.dtype(preferred_element_type)
    except TypeError:  # a torch dtype
        out = jnp.dtype(dtype_name(preferred_element_type))
    require(
        out.name in ACTIVATION_DTYPES,
        f"{OP}: preferred_element_type must be one of {', '.join(ACTIVATION_DTYPES)}, "
        f"got {out.name}",
    )
    return out


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _matmul(x, weight, scale, out_dtype: Any, block_sizes: Any, implementation: Any):
    return TABLE(
        x,
        weight,
        scale,
        out_dtype=out_dtype,
        block_sizes=block_sizes,
        implementation=implementation,
    )


def _matmul_fwd(x, weight, scale, out_dtype, block_sizes, implementation):
    return _matmul(x, weight, scale, out_dtype, block_sizes, implementation), (x, weight, scale)


def _matmul_bwd(out_dtype, block_sizes, implementation, residuals, dout):
    x, weight, scale = residuals
    dx = reference.input_gradient(weight, scale, weight_format(weight), dout, x.dtype)
    return dx, None, None


_matmul.defvjp(_matmul_fwd, _matmul_bwd)

# Sharding: the weight's output dim (``n``, over ``model`` by the conventions) splits freely; its
# contraction dim ``k`` (over ``data``) splits with partial products summed over the shards.
# Scales follow their weights: int8's [n] holds the output dim; fp8's block grid
# [n / 128, k / 128] holds both under the weight's factors, so a split reaches the scale only
# when its block count divides too (each shard then holds whole blocks).
_INT8 = Einsum("... k, n k, n -> ... n", reduced=("k",))
_FP8 = Einsum("... k, n k, n k -> ... n", reduced=("k",))


def sharding_rule(ranks: tuple = (), **options) -> Einsum:
    """The rule for the scale's rank (1: int8 per channel, 2: fp8 block grid)."""
    return _FP8 if len(ranks) > 2 and ranks[2] == 2 else _INT8


# Rows are independent: the torch op flattens leading dims and pads them to power-of-two buckets,
# so a decode loop compiles a handful of shapes, not one per length. A weight or scale that
# requires grad (in grad mode) is refused before any kernel runs.
@op(
    check=check_inputs,
    differentiable=("x",),
    frozen=("weight", "scale"),
    sharding=sharding_rule,
    jax_only=("block_sizes",),
    buckets=RowBuckets(inputs=("x",), outputs=(0,)),
)
def quantized_matmul(
    x: jax.Array,
    weight: jax.Array,
    scale: jax.Array,
    *,
    preferred_element_type: jax.typing.DTypeLike | None = None,
    implementation: str | None = None,
    block_sizes: BlockSizes | None = None,
) -> jax.Array:
    """A linear layer's ``x [..., in] @ W^T`` -> [..., out] with ``W = weight * scale`` kept
    quantized: ``weight`` int8 [out, in] with ``scale`` f32 [out] (per output channel), or
    float8_e4m3fn [out, in] with ``scale`` f32 [ceil(out / 128), ceil(in / 128)] (128 x 128
    blocks, Transformers' ``weight_scale_inv``, which multiplies).

    Exact against ``x @ dequantize(weight, scale)^T`` up to f32 rounding (accumulation in f32,
    f64 for f64 x). The result has ``preferred_element_type`` (default x's dtype).
    Differentiable in ``x`` only (the backward dequantizes the whole weight in XLA); the weight
    and its scale are frozen (``stop_gradient``). ``implementation``: "pallas" or "xla";
    ``block_sizes``: the Pallas blocks (``BlockSizes``).
    """
    out_dtype = _out_dtype(x.dtype, preferred_element_type)
    lead, (n, k) = x.shape[:-1], weight.shape
    rows = math.prod(lead)
    if 0 in (rows, n, k):
        return jnp.zeros((*lead, n), out_dtype)
    y = _matmul(
        x.reshape(rows, k),
        jax.lax.stop_gradient(weight),
        jax.lax.stop_gradient(scale),
        out_dtype,
        block_sizes,
        implementation,
    )
    return y.reshape(*lead, n)
