"""Public JAX API: ``quantized_matmul`` (a linear layer's ``x @ W^T`` with W kept quantized, int8
or fp8 [out, in]) and ``quantized_matmul_int4`` (the same with a GPTQ-packed int4 [in / 8, out]
weight: its own op, as its layout has its own sharding rule), their implementation tables
(pallas, xla), input checks and the activations' gradient."""

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

from . import int4, pallas_tpu, reference

OP = "quantized_matmul"
OP_INT4 = "quantized_matmul_int4"
FORMATS = {"int8": "int8", "float8_e4m3fn": "fp8", "int32": "int4"}
"""Stored weight dtype -> its format (``kernel_api.weight_formats``)."""
ACTIVATION_DTYPES = ("float32", "bfloat16", "float64")
OP_FORMATS = {OP: ("int8", "float8_e4m3fn"), OP_INT4: ("int32",)}
"""op -> the weight dtypes it takes."""
__all__ = ["TABLE", "TABLE_INT4", "BlockSizes", "quantized_matmul", "quantized_matmul_int4"]
BlockSizes = pallas_tpu.BlockSizes


def weight_format(weight) -> str:
    """The format of a quantized weight, from its dtype (JAX/numpy or torch)."""
    return FORMATS[dtype_name(weight.dtype)]


def scale_shape(fmt: str, out: int, inner: int) -> tuple[int, ...]:
    """The stored scale shape of an [out, in] layer's weight: int8 one per output channel, fp8
    one per 128 x 128 block (the last ones ragged), int4 one per group of 128 inputs and
    output ([in / 128, out])."""
    if fmt == "int4":
        return int4.scale_shape((inner // int4.PER_WORD, out))
    return weight_formats.scale_shape(fmt, (1, out, inner))[1:]


def weight_dims(weight) -> tuple[int, int]:
    """(out, in) of the layer a quantized weight holds: int8/fp8 are stored [out, in], int4
    GPTQ-packed [in / 8, out]."""
    if weight_format(weight) == "int4":
        packed, out = weight.shape
        return out, packed * int4.PER_WORD
    return tuple(weight.shape)


SCALE_LAYOUTS = {
    "int8": "one per output channel",
    "fp8": "one per 128x128 block",
    "int4": "one per group of 128 inputs and output column",
}
WEIGHT_LAYOUTS = {
    "int8": "[out, in], a Linear's layout",
    "fp8": "[out, in], a Linear's layout",
    "int4": "GPTQ-packed [in / 8, out]",
}


def check_inputs(x, weight, scale) -> None:
    """Shape and dtype rules shared by the JAX function and the torch op (int8, fp8)."""
    _check(OP, x, weight, scale)


def check_int4_inputs(x, weight, scale, zeros=None) -> None:
    """Shape and dtype rules shared by the JAX function and the torch op (int4): ``zeros``,
    when given, is int32 shaped as the scale."""
    _check(OP_INT4, x, weight, scale)
    if zeros is not None:
        check_dtype(OP_INT4, "zeros", zeros, ("int32",))
        require(
            tuple(zeros.shape) == tuple(scale.shape),
            f"{OP_INT4}: zeros {tuple(zeros.shape)} must have the scale's shape "
            f"{tuple(scale.shape)} (one zero point per group of {int4.GROUP} inputs and output "
            f"column)",
        )


def _check(op_name: str, x, weight, scale) -> None:
    check_rank(op_name, "x", x, (1, 8))
    check_rank(op_name, "weight", weight, 2)
    check_dtype(op_name, "x", x, ACTIVATION_DTYPES)
    check_dtype(op_name, "weight", weight, OP_FORMATS[op_name])
    check_dtype(op_name, "scale", scale, ("float32",))
    fmt = weight_format(weight)
    out, inner = weight_dims(weight)
    require(
        x.shape[-1] == inner,
        f"{op_name}: x {tuple(x.shape)} has {x.shape[-1]} features but {fmt} weight "
        f"{tuple(weight.shape)} ({WEIGHT_LAYOUTS[fmt]}) takes {inner}",
    )
    if fmt == "int4":
        group = int4.GROUP
        require(
            inner % group == 0,
            f"{op_name}: int4 weight {tuple(weight.shape)} holds {inner} inputs; int4 needs whole "
            f"groups of {group} (in a multiple of {group})",
        )
    expected = scale_shape(fmt, out, inner)
    require(
        tuple(scale.shape) == expected,
        f"{op_name}: {fmt} weight {tuple(weight.shape)} needs scale of shape {expected} "
        f"({SCALE_LAYOUTS[fmt]}), got {tuple(scale.shape)}",
    )


def _generation() -> str | None:
    device = jax_default_device()
    return tpu_generation(device) if jax_platform() == "tpu" else None


ACTIVATIONS = ("int8",)
NO_INT8_MXU = ("v4",)
"""Generations whose Mosaic rejects int8 matmul operands (measured: v4, E2001)."""
"""``activations`` values: "int8" quantizes each token's row dynamically (W8A8, int8 weights)."""


def _blocks(x, weight, block_sizes: BlockSizes | None) -> BlockSizes:
    if block_sizes is not None:
        return block_sizes
    (m, k), (n, _) = x.shape, weight_dims(weight)
    if jax_platform() == "cpu":  # interpret mode: the grid is a loop, one step is fastest
        return BlockSizes(m, n, k)
    return pallas_tpu.default_block_sizes(m, n, k, x.dtype, _generation(), weight_format(weight))


def _pallas(x, weight, scale, zeros, *, out_dtype, block_sizes, activations):
    if activations == "int8":
        q, x_scale = reference.quantize_rows(x)
        return pallas_tpu.w8a8_matmul(
            q,
            x_scale,
            weight,
            scale,
            out_dtype=out_dtype,
            blocks=_blocks(q, weight, block_sizes),
            interpret=jax_platform() == "cpu",
        )
    return pallas_tpu.quantized_matmul(
        x,
        weight,
        scale,
        fmt=weight_format(weight),
        out_dtype=out_dtype,
        blocks=_blocks(x, weight, block_sizes),
        interpret=jax_platform() == "cpu",
        zeros=zeros,
    )


def _pallas_problem(x, weight, scale, zeros, *, out_dtype, block_sizes, activations):
    if problem := float64_problem(x):
        return problem
    if activations == "int8" and _generation() in NO_INT8_MXU:
        return f"Mosaic has no int8 x int8 matmul on {_generation()} (W8A8 runs in XLA there)"
    if block_sizes is None:
        return None
    (m, k), (n, _) = x.shape, weight_dims(weight)
    dtype = jnp.int8 if activations == "int8" else x.dtype
    return pallas_tpu.block_problem(m, n, k, dtype, block_sizes, weight_format(weight))


def _xla(x, weight, scale, zeros, *, out_dtype, block_sizes, activations):
    if activations == "int8":
        return reference.w8a8_matmul(x, weight, scale, out_dtype)
    return reference.quantized_matmul(x, weight, scale, weight_format(weight), out_dtype, zeros)


TABLE = pallas_and_xla(OP, _pallas, _xla, _pallas_problem)
TABLE_INT4 = pallas_and_xla(OP_INT4, _pallas, _xla, _pallas_problem)
TABLES = {OP: TABLE, OP_INT4: TABLE_INT4}


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


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _matmul(x, weight, scale, zeros, out_dtype: Any, block_sizes: Any, implementation: Any,
            activations: Any):  # fmt: skip
    return TABLES[OP_INT4 if weight_format(weight) == "int4" else OP](
        x,
        weight,
        scale,
        zeros,
        out_dtype=out_dtype,
        block_sizes=block_sizes,
        activations=activations,
        implementation=implementation,
    )


def _matmul_fwd(x, weight, scale, zeros, out_dtype, block_sizes, implementation, activations):
    y = _matmul(x, weight, scale, zeros, out_dtype, block_sizes, implementation, activations)
    return y, (x, weight, scale, zeros)


def _matmul_bwd(out_dtype, block_sizes, implementation, activations, residuals, dout):
    require(
        activations is None,
        f"{OP}: activations={activations!r} (W8A8) has no gradient: rounding the activations "
        f"is inference only; use activations=None (W8A16) to train through the layer",
    )
    x, weight, scale, zeros = residuals
    dx = reference.input_gradient(weight, scale, weight_format(weight), dout, x.dtype, zeros)
    return dx, None, None, None


_matmul.defvjp(_matmul_fwd, _matmul_bwd)

# Sharding: the weight's output dim (``n``, over ``model`` by the conventions) splits freely; its
# contraction dim ``k`` (over ``data``) splits with partial products summed over the shards.
# Scales follow their weights: int8's [n] holds the output dim; fp8's block grid
# [n / 128, k / 128] holds both under the weight's factors, so a split reaches the scale only
# when its block count divides too (each shard then holds whole blocks). int4's packed rows and
# scale (and zero-point) groups are k at 1/8 and 1/128 (factors of their own): k stays whole,
# n splits.
_INT8 = Einsum("... k, n k, n -> ... n", reduced=("k",))
_FP8 = Einsum("... k, n k, n k -> ... n", reduced=("k",))
_INT4 = Einsum("... k, p n, g n, g n -> ... n", whole=("k", "p", "g"))


def sharding_rule(ranks: tuple = (), **options) -> Einsum:
    """The rule for the scale's rank (1: int8 per channel, 2: fp8 block grid)."""
    return _FP8 if len(ranks) > 2 and ranks[2] == 2 else _INT8


def _apply(x, weight, scale, preferred_element_type, implementation, block_sizes,
           activations=None, zeros=None) -> jax.Array:  # fmt: skip
    out_dtype = _out_dtype(x.dtype, preferred_element_type)
    if activations is not None:
        require(
            activations in ACTIVATIONS and weight_format(weight) == "int8",
            f"{OP}: activations={activations!r} with a {weight_format(weight)} weight; valid: "
            f"None, or 'int8' (W8A8: dynamic per-token int8 activations) with an int8 weight",
        )
    lead, (n, k) = x.shape[:-1], weight_dims(weight)
    rows = math.prod(lead)
    if 0 in (rows, n, k):
        return jnp.zeros((*lead, n), out_dtype)
    y = _matmul(
        x.reshape(rows, k),
        jax.lax.stop_gradient(weight),
        jax.lax.stop_gradient(scale),
        None if zeros is None else jax.lax.stop_gradient(zeros),
        out_dtype,
        block_sizes,
        implementation,
        activations,
    )
    return y.reshape(*lead, n)


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
    activations: str | None = None,
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

    ``activations="int8"`` (int8 weights only; opt-in, lossy) is W8A8: each token's row of x is
    quantized to int8 with its own scale (largest magnitude at 127, rounded half to even), the
    product accumulated exactly in int32 and rescaled once in f32; exact against ``x'`` @
    ``dequantize(weight, scale)^T`` with ``x'`` the dequantized int8 rows. No gradient.
    """
    return _apply(
        x, weight, scale, preferred_element_type, implementation, block_sizes, activations
    )


@op(
    check=check_int4_inputs,
    differentiable=("x",),
    frozen=("weight", "scale", "zeros"),
    sharding=_INT4,
    jax_only=("block_sizes",),
    buckets=RowBuckets(inputs=("x",), outputs=(0,)),
    torch_after={"implementation": ("zeros",)},  # added in 1.2: last in the torch op
)
def quantized_matmul_int4(
    x: jax.Array,
    weight: jax.Array,
    scale: jax.Array,
    zeros: jax.Array | None = None,
    *,
    preferred_element_type: jax.typing.DTypeLike | None = None,
    implementation: str | None = None,
    block_sizes: BlockSizes | None = None,
) -> jax.Array:
    """A linear layer's ``x [..., in] @ W`` -> [..., out] with W int4 group-wise, kept packed:
    ``weight`` int32 [in / 8, out] in GPTQ's packing (eight 4-bit values per word along ``in``,
    value j of word r in bits 4j..4j+3 is input row 8r + j) and ``scale`` f32 [in / 128, out]
    (one per group of 128 inputs and output column); ``zeros`` int32 [in / 128, out] (the zero
    point subtracted, 0..15, per group and output column: asymmetric, GPTQ ``sym: false`` and
    AWQ) or None (symmetric, zero point 8):
    ``W[i, o] = (nibble - zeros[i // 128, o]) * scale[i // 128, o]``. ``in`` is a multiple of
    128.

    Exact against ``x @ dequantize(weight, scale, zeros)`` up to f32 rounding; the rest as
    ``quantized_matmul``.
    """
    return _apply(
        x, weight, scale, preferred_element_type, implementation, block_sizes, zeros=zeros
    )
