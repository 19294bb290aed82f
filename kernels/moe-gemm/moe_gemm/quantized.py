"""The kernels of ``api.gmm_quantized``: grouped matmul of activations with quantized expert
weights (int8 per output channel, fp8 e4m3 in 128 x 128 blocks; ``kernel_api.weight_formats``),
for the training/prefill path of quantized models.

The weight stays quantized in HBM; the Pallas kernel converts each block in VMEM and applies
its scales there, accumulating in f32; the XLA implementation dequantizes the whole weight first
(Transformers' order: ``weight * scale`` in f32, rounded once to the activation dtype). Only the
activations are differentiable: ``d lhs = gmm_quantized(d out, weight, scale)`` with the other
contraction, dequantized the same way. Quantized weights are frozen: no gradient reaches the
weight or its scales (the torch op refuses a weight or scale that requires one, in grad mode;
the experts integration refuses such modules).
"""

from __future__ import annotations

import functools
from typing import Any

import jax

from kernel_hub.kernel_api import (
    check_dtype,
    check_rank,
    dtype_name,
    jax_platform,
    require,
    weight_formats,
)

from . import pallas_tpu, reference

WEIGHT_FORMATS = {"int8": "int8", "float8_e4m3fn": "fp8"}
"""Weight dtype -> its format (``weight_formats``)."""
FLOAT_DTYPES = ("float32", "bfloat16", "float64")


def weight_format(weight) -> str:
    """The format of a quantized weight, from its dtype (JAX/numpy or torch)."""
    return WEIGHT_FORMATS[dtype_name(weight.dtype)]


def check_inputs(lhs, weight, scale, group_sizes, transpose_rhs: bool) -> None:
    """Shape and dtype rules of ``gmm_quantized``, shared by the JAX function and the torch op."""
    op = "gmm_quantized"
    check_rank(op, "lhs", lhs, 2)
    check_rank(op, "weight", weight, 3)
    check_dtype(op, "lhs", lhs, FLOAT_DTYPES)
    check_dtype(op, "weight", weight, tuple(WEIGHT_FORMATS))
    check_dtype(op, "scale", scale, ("float32",))
    fmt = weight_format(weight)
    experts, out, inner = weight.shape
    if fmt == "fp8":
        require(
            out % weight_formats.FP8_BLOCK == 0 and inner % weight_formats.FP8_BLOCK == 0,
            f"{op}: fp8 weight {tuple(weight.shape)} must be whole 128x128 blocks "
            f"([E, out, in] with out and in multiples of 128)",
        )
    expected = weight_formats.scale_shape(fmt, tuple(weight.shape))
    require(
        tuple(scale.shape) == expected,
        f"{op}: {fmt} weight {tuple(weight.shape)} needs scale of shape {expected} "
        f"({'one per output channel' if fmt == 'int8' else 'one per 128x128 block'}), got "
        f"{tuple(scale.shape)}",
    )
    k = inner if transpose_rhs else out
    layout = "[E, out, in] contracting in" if transpose_rhs else "[E, out, in] contracting out"
    require(
        lhs.shape[1] == k,
        f"{op}: lhs {tuple(lhs.shape)} has k={lhs.shape[1]} but weight {tuple(weight.shape)} "
        f"read as {layout} (transpose_rhs={transpose_rhs}) has k={k}",
    )
    check_rank(op, "group_sizes", group_sizes, 1)
    check_dtype(op, "group_sizes", group_sizes, ("int32", "int64"))
    require(
        group_sizes.shape[0] == experts,
        f"{op}: group_sizes has {group_sizes.shape[0]} entries but weight has {experts} experts; "
        f"it needs one size per expert",
    )


def _interpret() -> bool:
    return jax_platform() == "cpu"


def _pallas(lhs, weight, scale, sizes, *, transpose_rhs, out_dtype, tiling):
    return pallas_tpu.gmm_quantized(
        lhs,
        weight,
        scale,
        sizes,
        quantization=weight_format(weight),
        transpose_rhs=transpose_rhs,
        out_dtype=out_dtype,
        tiling=tiling,
        interpret=_interpret(),
    )


def _xla(lhs, weight, scale, sizes, *, transpose_rhs, out_dtype, tiling):
    rhs = weight_formats.dequantize(weight, scale, weight_format(weight), lhs.dtype)
    return reference.gmm(lhs, rhs, sizes, transpose_rhs=transpose_rhs, out_dtype=out_dtype)


KERNELS = {"pallas": _pallas, "xla": _xla}


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _gmm(name: str, transpose_rhs: bool, out_dtype: Any, tiling: Any, lhs, weight, scale, sizes):
    return KERNELS[name](
        lhs, weight, scale, sizes, transpose_rhs=transpose_rhs, out_dtype=out_dtype, tiling=tiling
    )


def _gmm_fwd(name, transpose_rhs, out_dtype, tiling, lhs, weight, scale, sizes):
    out = _gmm(name, transpose_rhs, out_dtype, tiling, lhs, weight, scale, sizes)
    return out, (lhs, weight, scale, sizes)


def _gmm_bwd(name, transpose_rhs, out_dtype, tiling, residuals, dout):
    lhs, weight, scale, sizes = residuals
    dlhs = backward(name, weight, scale, sizes, dout.astype(lhs.dtype), transpose_rhs)
    return dlhs, None, None, None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


def backward(name: str, weight, scale, sizes, dout, transpose_rhs: bool):
    """``d lhs`` of a forward with ``transpose_rhs``: the other contraction of the same
    dequantized weight, with the implementation's default tiling."""
    return _gmm(name, not transpose_rhs, dout.dtype, None, dout, weight, scale, sizes)


def differentiable(name: str):
    """Implementation ``name``'s kernel, differentiable in ``lhs`` (table entry)."""

    def run(lhs, weight, scale, sizes, *, transpose_rhs, out_dtype, tiling):
        return _gmm(name, transpose_rhs, out_dtype, tiling, lhs, weight, scale, sizes)

    return run
