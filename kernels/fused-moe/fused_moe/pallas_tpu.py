"""The fused MoE experts kernel for TPU: dispatch, gate/up + activation, down + weighted combine
in one ``pallas_call``.

Grid ``(E, I / ti)``, both sequential. Step (e, j) reads block j of expert e's gate, up and down
weights (each weight block once per call; an expert without rows stays on blocks already in VMEM,
so its weights are never read). For each ``tm``-row chunk of the expert's rows (``dispatch``):

* j == 0: gather the chunk's token rows from ``hidden_states`` (held whole in VMEM) with a 0/1
  selection matmul into a per-expert scratch: no ``[T * k, H]`` copy ever goes to HBM;
* every j: ``act(x W_gate_j^T, x W_up_j^T) W_down_j^T`` accumulated in f32 over j;
* last j: add the down bias, multiply by the router weights and scatter-add into the f32 ``[T, H]``
  output accumulator with the transposed selection matmul. The output is written once, at the end.

Quantized weights (int8 per channel, fp8 128x128 blocks, mxfp4) are converted to the activation
dtype in VMEM: int8 scales multiply the f32 product per output column; fp8 scales multiply each
128-wide slice of the contraction. w8a8 quantizes the rows to int8 per token and 128 columns;
each group's int8 x int8 product accumulates in int32, then both scales multiply. mxfp4 bytes
hold the values at even and odd contraction positions: the kernel decodes both nibbles,
multiplies by their group's power of two (expanded along lanes by an exact 0/1 matmul) and
contracts them with the even and odd columns of the activations (``hidden_states`` split
outside the kernel; the gated activation split in VMEM). Selection matmuls and f32 operands use
full precision, so gathers and scatters are exact.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernel_hub.kernel_api import tiling, weight_formats

from .blocks import Blocks, vmem_bytes
from .config import ExpertsConfig
from .dispatch import Dispatch, cdiv, dispatch
from .quant import ACT_GROUP, FP8_BLOCK, MX_GROUP, e8m0_values, quantize_rows, unpack_fp4


def _precision(dtype):
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype).itemsize >= 4 else None


def _acc(dtype):
    """f32, or f64 for f64 operands (interpret mode)."""
    return jnp.promote_types(dtype, jnp.float32)


def _dot(a, b, *, transpose_b: bool, precision):
    dims = (((1,), (1 if transpose_b else 0,)), ((), ()))
    acc = _acc(jnp.promote_types(a.dtype, b.dtype))
    return jax.lax.dot_general(a, b, dims, precision=precision, preferred_element_type=acc)


def _project(x, w, scale, *, transpose_w: bool, quantization, precision):
    """``x @ W^T`` (or ``x @ W``) of one weight block in f32; quantized blocks dequantized."""
    if quantization is None:
        return _dot(x, w, transpose_b=transpose_w, precision=precision)
    if quantization == "w8a8":  # int8 x int8 -> int32 per 128-column group, then both scales
        xq, x_scale = quantize_rows(x)
        dims = (((1,), (1 if transpose_w else 0,)), ((), ()))
        out = None
        for g in range(x.shape[1] // ACT_GROUP):
            cols = slice(g * ACT_GROUP, (g + 1) * ACT_GROUP)
            w_part = w[:, cols] if transpose_w else w[cols, :]
            acc = jax.lax.dot_general(xq[:, cols], w_part, dims, preferred_element_type=jnp.int32)
            part = acc.astype(jnp.float32) * x_scale[:, g : g + 1]
            out = part if out is None else out + part
        return out * scale
    w = w.astype(x.dtype)
    if quantization == "int8":
        return _dot(x, w, transpose_b=transpose_w, precision=precision) * scale
    # fp8: one scale per 128-wide slice of the contraction, laid out [in / 128, out]
    out = None
    for kb in range(x.shape[1] // FP8_BLOCK):
        cols = slice(kb * FP8_BLOCK, (kb + 1) * FP8_BLOCK)
        part = _dot(x[:, cols], w[:, cols], transpose_b=True, precision=precision)
        part = part * scale[kb : kb + 1, :]
        out = part if out is None else out + part
    return out


def _mxfp4_weights(w, scale, first_byte, dtype):
    """(even, odd) dequantized halves [rows, bytes] of an mxfp4 block: packed ``w`` [rows, bytes]
    and the int8-viewed exponents ``scale`` [rows, groups] of every group from the one holding
    byte 0 of the axis (``first_byte``: the block's offset along the packed axis)."""
    groups, width = scale.shape[1], w.shape[1]
    group = jax.lax.broadcasted_iota(jnp.int32, (groups, width), 0)
    byte = first_byte + jax.lax.broadcasted_iota(jnp.int32, (groups, width), 1)
    expand = (group == byte // (MX_GROUP // 2)).astype(jnp.bfloat16)
    # powers of two and 0/1 are exact in bf16, and each output sums one product: exact
    factor = jax.lax.dot_general(
        e8m0_values(scale.astype(jnp.int32) & 0xFF).astype(jnp.bfloat16),
        expand,
        (((1,), (0,)), ((), ())),
        preferred_element_type=jnp.float32,
    )
    even, odd = unpack_fp4(w)
    return (even * factor).astype(dtype), (odd * factor).astype(dtype)


def _project_mxfp4(x_even, x_odd, w, scale, first_byte, precision):
    """``x @ W^T`` of one mxfp4 block in f32 from the even / odd contraction columns of x."""
    w_even, w_odd = _mxfp4_weights(w, scale, first_byte, x_even.dtype)
    return _dot(x_even, w_even, transpose_b=True, precision=precision) + _dot(
        x_odd, w_odd, transpose_b=True, precision=precision
    )


def _deinterleave(h):
    """(even columns, odd columns) of f32 ``h`` by exact 0/1 selection matmuls (Mosaic has no
    lane-strided slices)."""
    wide, half = h.shape[1], h.shape[1] // 2
    source = jax.lax.broadcasted_iota(jnp.int32, (wide, half), 0)
    target = 2 * jax.lax.broadcasted_iota(jnp.int32, (wide, half), 1)
    pick = lambda parity: (source == target + parity).astype(h.dtype)
    full = jax.lax.Precision.HIGHEST
    return (
        _dot(h, pick(0), transpose_b=False, precision=full),
        _dot(h, pick(1), transpose_b=False, precision=full),
    )


def _kernel(
    chunks_ref,
    offsets_ref,
    weight_expert_ref,
    weight_block_ref,
    tokens_ref,
    row_weights_ref,
    *refs,
    config: ExpertsConfig,
    tm: int,
    has_gate_up_bias: bool,
    has_down_bias: bool,
):
    refs = list(refs)
    take = lambda n: [refs.pop(0) for _ in range(n)]
    x_refs = take(config.packing)  # mxfp4: even and odd columns
    gate_up_refs = take(1 if config.interleaved else 2)
    gate_up_bias_refs = take(len(gate_up_refs)) if has_gate_up_bias else [None] * len(gate_up_refs)
    quantized = config.quantization is not None
    gate_up_scale_refs = take(len(gate_up_refs)) if quantized else [None] * len(gate_up_refs)
    (down_ref,) = take(1)
    down_bias_ref = take(1)[0] if has_down_bias else None
    down_scale_ref = take(1)[0] if quantized else None
    out_ref, *xs_refs, hacc_ref, oacc_ref = refs
    mxfp4 = config.quantization == "mxfp4"

    e, j = pl.program_id(0), pl.program_id(1)
    last_e, last_j = pl.num_programs(0) - 1, pl.num_programs(1) - 1
    n, base = chunks_ref[e], offsets_ref[e]
    tokens = x_refs[0].shape[0]
    cdt = x_refs[0].dtype
    precision = _precision(cdt)

    @pl.when((e == 0) & (j == 0))
    def _():
        oacc_ref[...] = jnp.zeros_like(oacc_ref)

    def rows(c):
        return pl.ds(pl.multiple_of(c * tm, tm), tm)

    def selection(c, dtype):
        """[tm, T] 0/1: row r of chunk c is token ``tokens_ref[...]`` (none for padding)."""
        ids = tokens_ref[pl.ds(pl.multiple_of(base + c * tm, tm), tm), :]
        return (ids == jax.lax.broadcasted_iota(jnp.int32, (tm, tokens), 1)).astype(dtype)

    @pl.when(j == 0)
    def _():
        def gather(c, carry):
            sel = selection(c, cdt)
            for x_ref, xs_ref in zip(x_refs, xs_refs, strict=True):
                picked = _dot(sel, x_ref[...], transpose_b=False, precision=precision)
                xs_ref[rows(c), :] = picked.astype(cdt)
            return carry

        jax.lax.fori_loop(0, n, gather, 0)

    def read(ref):
        return None if ref is None else ref[...]

    gate_up_scales = [read(ref) for ref in gate_up_scale_refs]
    down_scale = read(down_scale_ref)
    if config.quantization == "fp8":  # this step's blocks of the expert's raw block scales
        hidden_blocks = x_refs[0].shape[1] // FP8_BLOCK
        for h, w_ref in enumerate(gate_up_refs):
            per_half = gate_up_scales[h].shape[0] // len(gate_up_refs)
            out_blocks = w_ref.shape[0] // FP8_BLOCK
            first = h * per_half + j * out_blocks
            gate_up_scales[h] = weight_formats.fp8_block_scales(
                gate_up_scales[h], first, out_blocks, 0, hidden_blocks, contract_out=False
            )
        in_blocks = down_ref.shape[1] // FP8_BLOCK
        down_scale = weight_formats.fp8_block_scales(
            down_scale, 0, hidden_blocks, j * in_blocks, in_blocks, contract_out=False
        )

    def expert_chunk(c, carry):
        xs = [xs_ref[rows(c), :] for xs_ref in xs_refs]
        projected = []
        for w_ref, b_ref, scale in zip(
            gate_up_refs, gate_up_bias_refs, gate_up_scales, strict=True
        ):
            if mxfp4:
                h = _project_mxfp4(*xs, w_ref[...], scale, 0, precision)
            else:
                h = _project(
                    xs[0],
                    w_ref[...],
                    scale,
                    transpose_w=not config.transposed,
                    quantization=config.quantization,
                    precision=precision,
                )
            if b_ref is not None:
                h = h + b_ref[...].astype(h.dtype)
            projected.append(h)
        if config.interleaved:
            gate, up = _deinterleave(projected[0])
        else:
            gate, up = projected
        act = config.activation(gate, up)
        if mxfp4:
            even, odd = (a.astype(cdt) for a in _deinterleave(act))
            first_byte = j * down_ref.shape[1]
            partial = _project_mxfp4(even, odd, down_ref[...], down_scale, first_byte, precision)
        else:
            partial = _project(  # w8a8 quantizes the f32 activation itself
                act if config.quantization == "w8a8" else act.astype(cdt),
                down_ref[...],
                down_scale,
                transpose_w=not config.transposed,
                quantization=config.quantization,
                precision=precision,
            )
        previous = jnp.where(j == 0, 0.0, hacc_ref[rows(c), :])
        hacc_ref[rows(c), :] = previous + partial
        return carry

    jax.lax.fori_loop(0, n, expert_chunk, 0)

    @pl.when(j == last_j)
    def _():
        def scatter(c, carry):
            y = hacc_ref[rows(c), :]
            if down_bias_ref is not None:
                y = y + down_bias_ref[...].astype(y.dtype)
            weights = row_weights_ref[pl.ds(pl.multiple_of(base + c * tm, tm), tm), :]
            y = (y * weights).astype(out_ref.dtype)
            sel = selection(c, y.dtype)
            oacc_ref[...] += jax.lax.dot_general(
                sel,
                y,
                (((0,), (0,)), ((), ())),
                precision=_precision(y.dtype),
                preferred_element_type=oacc_ref.dtype,
            )
            return carry

        jax.lax.fori_loop(0, n, scatter, 0)

    @pl.when((e == last_e) & (j == last_j))
    def _():
        out_ref[...] = oacc_ref[...].astype(out_ref.dtype)


def _specs(config: ExpertsConfig, w_gate_up, w_down, blocks: Blocks, steps: int, **present):
    """BlockSpecs of the weight-side operands, in the kernel's order."""
    ti = blocks.ti
    hidden = config.hidden(w_gate_up.shape)
    packed = hidden // config.packing

    def whole_expert(e, j, chunks, offsets, we, wb):
        return (we[e], 0, 0)

    def block_index(e, j, wb_ref):
        return jnp.where(wb_ref[e] < 0, j, wb_ref[e])

    def along(offset: int, transposed_axis: bool):
        """Index map of a block ``offset`` steps further along the gate/up output axis."""

        def index(e, j, chunks, offsets, we, wb):
            jb = block_index(e, j, wb) + offset
            return (we[e], 0, jb) if transposed_axis else (we[e], jb, 0)

        return index

    halves = (0,) if config.interleaved else (0, steps)
    width = 2 * ti if config.interleaved else ti
    w_block = (None, hidden, width) if config.transposed else (None, width, packed)
    specs = [pl.BlockSpec(w_block, along(o, config.transposed)) for o in halves]
    if present["gate_up_bias"]:
        specs += [pl.BlockSpec((None, 1, width), along(o, True)) for o in halves]
    if config.weight_format == "int8":
        specs += [pl.BlockSpec((None, 1, width), along(o, True)) for o in halves]
    elif config.quantization == "fp8":  # the whole expert's raw block scales (1/4096 of bytes)
        shape = (None, 2 * steps * ti // FP8_BLOCK, hidden // FP8_BLOCK)
        specs += [pl.BlockSpec(shape, whole_expert) for _ in halves]
    elif config.quantization == "mxfp4":  # groups as stored (may be lane-padded)
        groups = present["gate_up_groups"]
        specs += [pl.BlockSpec((None, width, groups), along(o, False)) for o in halves]

    def down_index(e, j, chunks, offsets, we, wb):
        jb = block_index(e, j, wb)
        return (we[e], jb, 0) if config.transposed else (we[e], 0, jb)

    down_block = (None, ti, hidden) if config.transposed else (None, hidden, ti // config.packing)
    specs.append(pl.BlockSpec(down_block, down_index))
    if present["down_bias"]:
        specs.append(pl.BlockSpec((None, 1, hidden), whole_expert))
    if config.weight_format == "int8":
        specs.append(pl.BlockSpec((None, 1, hidden), whole_expert))
    elif config.quantization == "fp8":
        shape = (None, hidden // FP8_BLOCK, steps * ti // FP8_BLOCK)
        specs.append(pl.BlockSpec(shape, whole_expert))
    elif config.quantization == "mxfp4":  # the whole expert's [H, I / 32]: 1/16 of its bytes
        specs.append(pl.BlockSpec((None, hidden, present["down_groups"]), whole_expert))
    return specs


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
    blocks: Blocks,
    interpret: bool,
    vmem_capacity: int,
):
    """The fused experts for up to ``MAX_TOKENS`` tokens (see the module docstring). Biases are
    [E, 2I] / [E, H]; scales in ``quant.kernel_scale`` layout; ``vmem_capacity``: the chip's
    VMEM, the most the kernel may ask for."""
    tokens, hidden = x.shape
    top_k = top_k_index.shape[1]
    num_experts = w_gate_up.shape[0]
    intermediate = config.intermediate(w_gate_up.shape)
    steps = intermediate // blocks.ti
    tm = blocks.tm
    plan: Dispatch = dispatch(
        top_k_index, top_k_weights.astype(_acc(x.dtype)), num_experts, tm, steps
    )
    padded = plan.row_tokens.shape[0]

    # mxfp4 contracts even and odd columns separately (two values per byte)
    x_parts = [x[:, 0::2], x[:, 1::2]] if config.packing == 2 else [x]
    operands = [plan.row_tokens, plan.row_weights, *x_parts]
    in_specs = [
        pl.BlockSpec((padded, 1), lambda e, j, *_: (0, 0)),
        pl.BlockSpec((padded, 1), lambda e, j, *_: (0, 0)),
    ] + [pl.BlockSpec(part.shape, lambda e, j, *_: (0, 0)) for part in x_parts]
    halves = 1 if config.interleaved else 2
    operands += [w_gate_up] * halves
    if gate_up_bias is not None:
        operands += [gate_up_bias[:, None, :]] * halves
    if gate_up_scale is not None:
        operands += [gate_up_scale] * halves
    operands.append(w_down)
    if down_bias is not None:
        operands.append(down_bias[:, None, :])
    if down_scale is not None:
        operands.append(down_scale)
    in_specs += _specs(
        config,
        w_gate_up,
        w_down,
        blocks,
        steps,
        gate_up_bias=gate_up_bias is not None,
        down_bias=down_bias is not None,
        gate_up_groups=None if gate_up_scale is None else gate_up_scale.shape[-1],
        down_groups=None if down_scale is None else down_scale.shape[-1],
    )

    cap = cdiv(tokens, tm) * tm
    w_itemsize = jnp.dtype(w_gate_up.dtype).itemsize
    experts_read = min(num_experts, tokens * top_k)
    weight_bytes = experts_read * 3 * intermediate * hidden * w_itemsize // config.packing
    if gate_up_scale is not None:
        scale_bytes = gate_up_scale[0].size + down_scale[0].size
        weight_bytes += experts_read * scale_bytes * jnp.dtype(gate_up_scale.dtype).itemsize
    itemsize = jnp.dtype(x.dtype).itemsize
    cost = pl.CostEstimate(
        flops=2 * padded * hidden * 3 * intermediate + 4 * padded * tokens * hidden,
        transcendentals=padded * intermediate,
        bytes_accessed=weight_bytes + tokens * hidden * (itemsize + jnp.dtype(out_dtype).itemsize),
    )
    vmem = vmem_bytes(tokens, hidden, blocks, x.dtype, w_itemsize, config.quantization)
    kernel = functools.partial(
        _kernel,
        config=config,
        tm=tm,
        has_gate_up_bias=gate_up_bias is not None,
        has_down_bias=down_bias is not None,
    )
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((tokens, hidden), out_dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(num_experts, steps),
            in_specs=in_specs,
            out_specs=pl.BlockSpec((tokens, hidden), lambda e, j, *_: (0, 0)),
            scratch_shapes=[
                *(pltpu.VMEM((cap, part.shape[1]), x.dtype) for part in x_parts),
                pltpu.VMEM((cap, hidden), _acc(x.dtype)),
                pltpu.VMEM((tokens, hidden), _acc(x.dtype)),
            ],
        ),
        compiler_params=tiling.compiler_params(
            "arbitrary",
            "arbitrary",
            vmem_limit_bytes=min(vmem_capacity, int(vmem * 1.25) + (8 << 20)),
        ),
        cost_estimate=cost,
        interpret=interpret,
        name="fused_moe_experts",
    )(plan.chunks, plan.offsets, plan.weight_expert, plan.weight_block, *operands)
