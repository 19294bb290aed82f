"""The Pallas TPU kernel: ``x @ W^T`` with W quantized in HBM and dequantized block by block in
VMEM, accumulated in f32 across the contraction axis.

Grid (row blocks, output blocks, contraction blocks), the last "arbitrary" (it accumulates).
fp8: the whole block-scale grid [out / 128, in / 128] sits in VMEM (1/16384 of the weight's
elements); each weight block is converted to f32, multiplied by its 128 x 128 block scales and
rounded to the activation dtype before the MXU product, the order Transformers' dequantize uses.
int8: the weight block converts exactly to the activation dtype and its per-output-channel scale
multiplies the finished f32 accumulator (one multiply per output instead of per weight).
int4 (GPTQ packing, [in / 8, out] int32, eight values per word along ``in``): each packed block
is split into its eight nibble planes ([tk / 8, tn] each, plane j holding input rows 8r + j),
each plane shifted by its zero point (8, or the per-group, per-output ``zeros`` block [tk / 128,
tn] int32 read beside the scales), multiplied by its group scales (a plane row r lies in
group r // 16 of the block) in f32 and rounded to the activation dtype. The matching activation
columns (x[:, j::8]) are picked by exact 0/1 matmuls with permutation blocks built once per
output block in VMEM, so neither the weight nor the activations are relaid in HBM.
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

from . import int4

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
# int4: tk is a whole multiple of 1024 (its [tk / 128, tn] scale block a whole f32 sublane tile)
# or the whole contraction; picking x's columns costs tk / tn of the block's MXU work, so tk
# stays 1024.
INT4_K_BLOCK = 1024
# int4's tn: the weight budget counts 8 values per element (a packed word holds 8), so x is read
# once per 8x wider output block, as far as the f32 accumulator stays within 2 block budgets
# (Llama-3-8B down_proj prefill, 512 rows: v4 1024 columns, v5e/v5p 2048; decode 256 rows twice).
INT4_WIDTH = 8
PER_WORD = int4.PER_WORD
GROUP = int4.GROUP


def _fit(size: int, block: int) -> int:
    return size if size <= block else block


def default_block_sizes(m: int, n: int, k: int, dtype, generation: str | None,
                        fmt: str = "int8") -> BlockSizes:  # fmt: skip
    """Decode (m up to 512) runs in one row block, so the weight is read once. The whole
    contraction goes in one block when 128 output columns of it fit the generation's weight
    block (then x's block never changes and is fetched once); otherwise ``tk`` is 256 and
    ``tn`` as wide as the block allows (x is fetched once per output block). int4: ``tk`` at
    most 1024, ``tn`` up to 8x as wide as an 8-bit weight block's (a packed word holds 8
    values) while its f32 accumulator stays within two weight blocks."""
    elements = WEIGHT_BLOCK_ELEMENTS.get(generation or "", DEFAULT_WEIGHT_BLOCK_ELEMENTS)
    multiple = tiling.sublane_multiple(dtype)
    tm = min(MAX_ROW_BLOCK, -(-m // multiple) * multiple)
    if fmt == "int4":
        tk = k if k <= INT4_K_BLOCK else INT4_K_BLOCK
        tn = min(elements * INT4_WIDTH // tk, 2 * elements // tm) // LANES * LANES
        tn = max(LANES, tn)
    else:
        tk = k if k * LANES <= elements else SPLIT_K_BLOCK
        tn = max(LANES, elements // tk // LANES * LANES)
    return BlockSizes(tm=_fit(m, tm), tn=_fit(n, tn), tk=_fit(k, tk))


def block_problem(m: int, n: int, k: int, dtype, blocks: BlockSizes,
                  fmt: str = "int8") -> str | None:  # fmt: skip
    """Why ``blocks`` cannot tile an [m, k] x [n, k] product on a TPU, or None."""
    if problem := tiling.row_block_problem(m, blocks.tm, dtype, name="tm", axis="m"):
        return problem
    if fmt == "int4" and blocks.tk != k and (blocks.tk <= 0 or blocks.tk % INT4_K_BLOCK):
        return (
            f"int4: tk={blocks.tk} must equal the dimension ({k}) or be a multiple of "
            f"{INT4_K_BLOCK} (whole f32 tiles of group scales)"
        )
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


def _int4_kernel(x_ref, w_ref, s_ref, *refs, k: int, zeros: bool):
    z_ref, out_ref, acc_ref, pick_ref = refs if zeros else (None, *refs)
    k_step = pl.program_id(2)
    x = x_ref[...]
    tk = x.shape[1]
    rows, tn = w_ref.shape
    iota = jax.lax.broadcasted_iota

    @pl.when(k_step == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)
        column, row = iota(jnp.int32, (tk, rows), 0), iota(jnp.int32, (tk, rows), 1)
        for j in range(PER_WORD):  # plane j's columns of x: x[:, 8r + j] -> column r
            pick_ref[j] = (column == PER_WORD * row + j).astype(pick_ref.dtype)

    if k % tk:  # the last contraction block reads past k: keep its garbage out of the sum
        valid = k_step * tk + iota(jnp.int32, (1, tk), 1) < k
        x = jnp.where(valid, x, jnp.zeros_like(x))
        rows_valid = k_step * rows + iota(jnp.int32, (rows, 1), 0) < k // PER_WORD
    packed, scale = w_ref[...], s_ref[...].astype(jnp.float32)
    groups = rows * PER_WORD // GROUP
    per_group = rows // groups
    zero = int4.ZERO if z_ref is None else z_ref[...][:, None, :]

    def plane(j, carry):  # one loop step per nibble plane keeps Mosaic's program small
        nibbles = ((packed >> (4 * j)) & 0xF).reshape(groups, per_group, tn)
        w = (nibbles - zero).astype(jnp.float32) * scale[:, None, :]
        w = w.reshape(rows, tn).astype(x.dtype)
        if k % tk:
            w = jnp.where(rows_valid, w, jnp.zeros_like(w))
        x_plane = jax.lax.dot_general(
            x,
            pick_ref[j],
            (((1,), (0,)), ((), ())),
            precision=_precision(x.dtype),
            preferred_element_type=acc_ref.dtype,
        ).astype(x.dtype)  # exact: one 1 per column
        acc_ref[...] += jax.lax.dot_general(
            x_plane,
            w,
            (((1,), (0,)), ((), ())),
            precision=_precision(x.dtype),
            preferred_element_type=acc_ref.dtype,
        )
        return carry

    jax.lax.fori_loop(0, PER_WORD, plane, 0)

    @pl.when(k_step == pl.num_programs(2) - 1)
    def _():
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def cost(m: int, n: int, k: int, x_dtype, out_dtype, weight_bytes: int, scale_bytes: int,
         blocks: BlockSizes, fmt: str = "int8") -> pl.CostEstimate:  # fmt: skip
    """The block schedule's traffic: x is read once per output block (once in all when the
    contraction is one block: its block index never changes), the weight and its scales once
    per row block, the output written once. int4 adds the MXU work that picks x's columns per
    nibble plane (an [m, tk] x [tk, tk] product per contraction block and output block)."""
    row_blocks, col_blocks = pl.cdiv(m, blocks.tm), pl.cdiv(n, blocks.tn)
    x_reads = 1 if blocks.tk >= k else col_blocks
    picks = 2 * m * k * min(blocks.tk, k) * col_blocks if fmt == "int4" else 0
    return pl.CostEstimate(
        flops=2 * m * n * k + picks,
        transcendentals=0,
        bytes_accessed=m * k * jnp.dtype(x_dtype).itemsize * x_reads
        + (weight_bytes + scale_bytes) * row_blocks
        + m * n * jnp.dtype(out_dtype).itemsize,
    )


def quantized_matmul(x, weight, scale, *, fmt: str, out_dtype, blocks: BlockSizes,
                     interpret: bool, zeros=None):  # fmt: skip
    """``x [m, k] @ dequantize(weight [n, k], scale)^T`` -> [m, n] in ``out_dtype``; ``scale``
    in the format's stored layout (int8 [n], fp8 [ceil(n / 128), ceil(k / 128)]); int4:
    ``x @ dequantize(weight [k / 8, n], scale [k / 128, n], zeros [k / 128, n] or None)``."""
    if fmt == "int4":
        return _int4_matmul(x, weight, scale, zeros, out_dtype=out_dtype, blocks=blocks,
                            interpret=interpret)  # fmt: skip
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


MIB = 1 << 20
DEFAULT_SCOPED_VMEM = 16 * MIB  # v4's and v5e's default scoped limit


def int4_vmem_bytes(tm: int, tn: int, tk: int, x_dtype, out_dtype, zeros: bool = False) -> int:
    """VMEM an int4 grid step holds: double-buffered x, packed weight, scale (and zeros) and
    output blocks, the f32 accumulator, the 8 column-picking blocks and one nibble plane's
    temporaries (its int32 values, f32 and activation-dtype weights, the picked x columns)."""
    x_size, out_size = jnp.dtype(x_dtype).itemsize, jnp.dtype(out_dtype).itemsize
    rows = tk // PER_WORD
    group_blocks = (2 if zeros else 1) * tk // GROUP * tn * 4
    buffers = tm * tk * x_size + rows * tn * 4 + group_blocks + tm * tn * out_size
    plane = rows * tn * (4 + 4 + x_size) + tm * rows * 4
    return 2 * buffers + tm * tn * 4 + PER_WORD * tk * rows * x_size + plane


def _int4_matmul(x, weight, scale, zeros, *, out_dtype, blocks: BlockSizes, interpret: bool):
    (m, k), n = x.shape, weight.shape[1]
    tm, tn, tk = blocks.tm, blocks.tn, min(blocks.tk, k)
    acc = jnp.promote_types(x.dtype, jnp.float32)
    group_spec = pl.BlockSpec((tk // GROUP, tn), lambda i, j, kk: (kk, j))
    group_operands = (scale,) if zeros is None else (scale, zeros)
    # beyond the default scoped limit (wide decode blocks on v5e/v5p/v6e, whose VMEM is 95-128
    # MiB): ask for what the step holds plus half for Mosaic's own temporaries
    vmem = int4_vmem_bytes(tm, tn, tk, x.dtype, out_dtype, zeros is not None)
    vmem_limit = None if 2 * vmem <= DEFAULT_SCOPED_VMEM else vmem * 3 // 2
    return pl.pallas_call(
        functools.partial(_int4_kernel, k=k, zeros=zeros is not None),
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=(pl.cdiv(m, tm), pl.cdiv(n, tn), pl.cdiv(k, tk)),
        in_specs=[
            pl.BlockSpec((tm, tk), lambda i, j, kk: (i, kk)),
            pl.BlockSpec((tk // PER_WORD, tn), lambda i, j, kk: (kk, j)),
            *[group_spec] * len(group_operands),
        ],
        out_specs=pl.BlockSpec((tm, tn), lambda i, j, kk: (i, j)),
        scratch_shapes=[
            pltpu.VMEM((tm, tn), acc),
            pltpu.VMEM((PER_WORD, tk, tk // PER_WORD), x.dtype),
        ],
        compiler_params=tiling.compiler_params(
            "parallel", "parallel", "arbitrary", vmem_limit_bytes=vmem_limit
        ),
        cost_estimate=cost(
            m,
            n,
            k,
            x.dtype,
            out_dtype,
            weight.size * weight.dtype.itemsize,
            sum(a.size * a.dtype.itemsize for a in group_operands),
            blocks,
            "int4",
        ),
        interpret=interpret,
        name="quantized_matmul_int4" if zeros is None else "quantized_matmul_int4_zeros",
    )(x, weight, *group_operands)


def _w8a8_kernel(x_ref, xs_ref, w_ref, s_ref, out_ref, acc_ref, *, k: int):
    k_step = pl.program_id(2)

    @pl.when(k_step == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    x, w = x_ref[...], w_ref[...]
    tk = x.shape[1]
    if k % tk:  # the last contraction block reads past k: keep its garbage out of the sum
        valid = k_step * tk + jax.lax.broadcasted_iota(jnp.int32, (1, tk), 1) < k
        x = jnp.where(valid, x, jnp.zeros_like(x))
        w = jnp.where(valid, w, jnp.zeros_like(w))
    acc_ref[...] += jax.lax.dot_general(
        x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32
    )

    @pl.when(k_step == pl.num_programs(2) - 1)
    def _():
        result = acc_ref[...].astype(jnp.float32) * xs_ref[...] * s_ref[...]
        out_ref[...] = result.astype(out_ref.dtype)


def w8a8_matmul(x, x_scale, weight, scale, *, out_dtype, blocks: BlockSizes, interpret: bool):
    """``(x [m, k] int8 * x_scale [m, 1]) @ (weight [n, k] int8 * scale [n])^T`` -> [m, n]:
    int8 x int8 products accumulated exactly in int32 on the MXU, rescaled once in f32."""
    (m, k), n = x.shape, weight.shape[0]
    tm, tn, tk = blocks.tm, blocks.tn, blocks.tk
    return pl.pallas_call(
        functools.partial(_w8a8_kernel, k=k),
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=(pl.cdiv(m, tm), pl.cdiv(n, tn), pl.cdiv(k, tk)),
        in_specs=[
            pl.BlockSpec((tm, tk), lambda i, j, kk: (i, kk)),
            pl.BlockSpec((tm, 1), lambda i, j, kk: (i, 0)),
            pl.BlockSpec((tn, tk), lambda i, j, kk: (j, kk)),
            pl.BlockSpec((1, tn), lambda i, j, kk: (0, j)),
        ],
        out_specs=pl.BlockSpec((tm, tn), lambda i, j, kk: (i, j)),
        scratch_shapes=[pltpu.VMEM((tm, tn), jnp.int32)],
        compiler_params=tiling.compiler_params("parallel", "parallel", "arbitrary"),
        cost_estimate=cost(
            m, n, k, x.dtype, out_dtype, weight.size + 4 * m, 4 * scale.size, blocks
        ),
        interpret=interpret,
        name="quantized_matmul_w8a8",
    )(x, x_scale, weight, scale.reshape(1, n))
