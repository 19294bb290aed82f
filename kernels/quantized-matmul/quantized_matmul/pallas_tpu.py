"""The Pallas TPU kernel: ``x @ W^T`` with W quantized in HBM and dequantized block by block in
VMEM, accumulated in f32 across the contraction axis.

Grid (row blocks, output blocks, contraction blocks), the last "arbitrary" (it accumulates).
fp8: the whole block-scale grid [out / 128, in / 128] sits in VMEM (1/16384 of the weight's
elements); each weight block is converted to f32, multiplied by its 128 x 128 block scales and
rounded to the activation dtype before the MXU product, the order Transformers' dequantize uses.
int8: the weight block converts exactly to the activation dtype and its per-output-channel scale
multiplies the finished f32 accumulator (one multiply per output instead of per weight).
Weights and scales are read in their stored layout: nothing is copied or relaid per call.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernel_hub.kernel_api import tiling, weight_formats

BLOCK = weight_formats.FP8_BLOCK
LANES = 128


@dataclass(frozen=True)
class BlockSizes:
    """Rows of x (``tm``), output columns (``tn``) and contraction columns (``tk``) per grid step.
    Each is a multiple of its tile (``tm``: the activation dtype's sublane tile; ``tn``, ``tk``:
    128, which also keeps fp8 blocks whole) or the whole dimension."""

    tm: int
    tn: int
    tk: int


# Weight elements streamed per grid step, per generation (1 byte each for fp8/int8, converted to
# f32 and the activation dtype in VMEM, beside a [512, tn] f32 accumulator): v4's scoped VMEM is
# 16 MiB, v5e's MXU is 128 wide; v5p's default scoped VMEM does not hold a 1M-element block with
# a 512-row accumulator (Llama-3-8B down_proj prefill: CompileTimeScopedVmemOom), v6e's does.
WEIGHT_BLOCK_ELEMENTS = {"v4": 256 * 1024, "v5e": 512 * 1024, "v5p": 512 * 1024,
                         "v6e": 1024 * 1024}  # fmt: skip
DEFAULT_WEIGHT_BLOCK_ELEMENTS = 512 * 1024
MAX_ROW_BLOCK = 512
SPLIT_K_BLOCK = 256  # tk when the contraction is split: tn as wide as the block allows


def _fit(size: int, block: int) -> int:
    return size if size <= block else block


def default_block_sizes(m: int, n: int, k: int, dtype, generation: str | None) -> BlockSizes:
    """Decode (m up to 512) runs in one row block, so the weight is read once. The whole
    contraction goes in one block when 128 output columns of it fit the generation's weight
    block (then x's block never changes and is fetched once); otherwise ``tk`` is 256 and
    ``tn`` as wide as the block allows (x is fetched once per output block)."""
    elements = WEIGHT_BLOCK_ELEMENTS.get(generation or "", DEFAULT_WEIGHT_BLOCK_ELEMENTS)
    tk = k if k * LANES <= elements else SPLIT_K_BLOCK
    tn = max(LANES, elements // tk // LANES * LANES)
    multiple = tiling.sublane_multiple(dtype)
    tm = min(MAX_ROW_BLOCK, -(-m // multiple) * multiple)
    return BlockSizes(tm=_fit(m, tm), tn=_fit(n, tn), tk=_fit(k, tk))


def block_problem(m: int, n: int, k: int, dtype, blocks: BlockSizes) -> str | None:
    """Why ``blocks`` cannot tile an [m, k] x [n, k] product on a TPU, or None."""
    if problem := tiling.row_block_problem(m, blocks.tm, dtype, name="tm", axis="m"):
        return problem
    for name, size, block in (("tn", n, blocks.tn), ("tk", k, blocks.tk)):
        if block != size and (block <= 0 or block % LANES):
            return f"{name}={block} must equal the dimension ({size}) or be a multiple of {LANES}"
    return None


def _precision(dtype):
    # f32 operands: full-precision MXU passes, as XLA's f32 dot at HIGHEST.
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype).itemsize >= 4 else None


def _fp8_dequantized(w, scale, n_block, k_block, dtype):
    """One [tn, tk] e4m3 weight block times its 128 x 128 block scales (f32), in ``dtype``."""
    tn, tk = w.shape
    out_blocks, in_blocks = -(-tn // BLOCK), -(-tk // BLOCK)
    # [out_blocks, 128 * in_blocks]: each output block's scales, repeated over its columns
    scales = weight_formats.fp8_block_scales(
        scale, n_block * out_blocks, out_blocks, k_block * in_blocks, in_blocks, contract_out=True
    )[:, :tk]
    rows = [
        w[b * BLOCK : min(tn, (b + 1) * BLOCK), :].astype(jnp.float32) * scales[b : b + 1, :]
        for b in range(out_blocks)
    ]
    return (rows[0] if out_blocks == 1 else jnp.concatenate(rows, axis=0)).astype(dtype)


def _kernel(x_ref, w_ref, s_ref, out_ref, acc_ref, *, fmt: str, k: int):
    k_step = pl.program_id(2)

    @pl.when(k_step == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    x = x_ref[...]
    tk = x.shape[1]
    if fmt == "fp8":
        w = _fp8_dequantized(w_ref[...], s_ref[...], pl.program_id(1), k_step, x.dtype)
    else:
        w = w_ref[...].astype(x.dtype)  # int8 -> bf16/f32 is exact
    if k % tk:  # the last contraction block reads past k: keep its garbage out of the sum
        valid = k_step * tk + jax.lax.broadcasted_iota(jnp.int32, (1, tk), 1) < k
        x = jnp.where(valid, x, jnp.zeros_like(x))
        w = jnp.where(valid, w, jnp.zeros_like(w))
    acc_ref[...] += jax.lax.dot_general(
        x,
        w,
        (((1,), (1,)), ((), ())),
        precision=_precision(x.dtype),
        preferred_element_type=acc_ref.dtype,
    )

    @pl.when(k_step == pl.num_programs(2) - 1)
    def _():
        result = acc_ref[...]
        if fmt == "int8":
            result = result * s_ref[...]
        out_ref[...] = result.astype(out_ref.dtype)


def cost(m: int, n: int, k: int, x_dtype, out_dtype, weight_bytes: int, scale_bytes: int,
         blocks: BlockSizes) -> pl.CostEstimate:  # fmt: skip
    """The block schedule's traffic: x is read once per output block (once in all when the
    contraction is one block: its block index never changes), the weight and its scales once
    per row block, the output written once."""
    row_blocks, col_blocks = pl.cdiv(m, blocks.tm), pl.cdiv(n, blocks.tn)
    x_reads = 1 if blocks.tk >= k else col_blocks
    return pl.CostEstimate(
        flops=2 * m * n * k,
        transcendentals=0,
        bytes_accessed=m * k * jnp.dtype(x_dtype).itemsize * x_reads
        + (weight_bytes + scale_bytes) * row_blocks
        + m * n * jnp.dtype(out_dtype).itemsize,
    )


def quantized_matmul(x, weight, scale, *, fmt: str, out_dtype, blocks: BlockSizes,
                     interpret: bool):  # fmt: skip
    """``x [m, k] @ dequantize(weight [n, k], scale)^T`` -> [m, n] in ``out_dtype``; ``scale``
    in the format's stored layout (int8 [n], fp8 [ceil(n / 128), ceil(k / 128)])."""
    (m, k), n = x.shape, weight.shape[0]
    tm, tn, tk = blocks.tm, blocks.tn, blocks.tk
    if fmt == "int8":
        scale_operand = scale.reshape(1, n)  # a bitcast: [n] and [1, n] share a layout
        scale_spec = pl.BlockSpec((1, tn), lambda i, j, kk: (0, j))
    else:  # the whole block-scale grid, fetched once
        scale_operand = scale
        scale_spec = pl.BlockSpec(scale.shape, lambda i, j, kk: (0, 0))
    acc = jnp.promote_types(x.dtype, jnp.float32)
    return pl.pallas_call(
        functools.partial(_kernel, fmt=fmt, k=k),
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=(pl.cdiv(m, tm), pl.cdiv(n, tn), pl.cdiv(k, tk)),
        in_specs=[
            pl.BlockSpec((tm, tk), lambda i, j, kk: (i, kk)),
            pl.BlockSpec((tn, tk), lambda i, j, kk: (j, kk)),
            scale_spec,
        ],
        out_specs=pl.BlockSpec((tm, tn), lambda i, j, kk: (i, j)),
        scratch_shapes=[pltpu.VMEM((tm, tn), acc)],
        compiler_params=tiling.compiler_params("parallel", "parallel", "arbitrary"),
        cost_estimate=cost(
            m,
            n,
            k,
            x.dtype,
            out_dtype,
            weight.size * weight.dtype.itemsize,
            scale.size * scale.dtype.itemsize,
            blocks,
        ),
        interpret=interpret,
        name=f"quantized_matmul_{fmt}",
    )(x, weight, scale_operand)
