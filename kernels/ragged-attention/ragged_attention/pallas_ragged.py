"""Pallas ragged attention for TPU, forward only: blocked online softmax over packed sequences.

Keys and values are token-major, [N, Hkv, D], as Transformers' paged cache holds them, and are
read in place: a kv block is ``block_k`` tokens of every kv head, and the kernel takes head
``h`` as the strided slice ``k[:, h, :]`` in VMEM. (A heads-major or lane-merged view would need
XLA to transpose, i.e. copy, every key first on a TPU.) Nothing is padded when ``block_k``
divides N and ``block_q`` divides the query rows, as with the torch entry point's buckets.

Queries: the ``G = Hq // Hkv`` query heads sharing a kv head are packed into rows token-major,
q [T, Hq, D] -> [Hkv, T * G, D] (row ``t * G + g``, a small copy of q), so a block of rows covers
whole tokens and each kv block is used once for all G heads. Each row carries its token's
sequence id and key position (``masking.token_meta``), each key its sequence id and position,
so one block pair's mask is ``masking.allowed`` on those vectors.

Which kv blocks a q block visits is data: the packed key span of its rows (their sequences'
keys, cut by causality and the window) is computed before the kernel and prefetched into SMEM.
The grid's kv axis has as many steps as the longest possible span; steps past a q block's own
span are skipped, and their index map repeats the last visited block so they fetch nothing.

8-bit keys and values (an 8-bit cache read back, ``kv_quant``) come with f32 scales [Hkv, N]
(lane-dense: a kv block's scales of one head are one row). Each head's [block_k, D] slice is
converted to q's dtype in VMEM (exact) and the per-key scales are applied to the scores and to
the probabilities before the value dot (``q . (s k) = (q . k) s``), as the paged kernel does.

No backward: serving needs none.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernel_hub.kernel_api import tiling

from . import masking
from .masking import RaggedSpec

# Finite, so a row with no visible key so far keeps exp(m_prev - m_new) = 1 instead of NaN.
_MASK_VALUE = -1e30
LANES = 128


@dataclass(frozen=True)
class RaggedBlocks:
    """``q``: packed query rows per block (tokens x G); ``k``: keys per block."""

    q: int
    k: int


def sublanes(dtype) -> int:
    """Rows in one TPU vreg tile: 8 for 32-bit, 16 for 16-bit types."""
    return 8 * max(1, 4 // jnp.dtype(dtype).itemsize)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class Layout:
    """Static geometry of one call."""

    kv_heads: int
    groups: int
    rows: int
    rows_padded: int
    block_q: int
    keys: int
    keys_padded: int
    block_k: int
    head_dim: int

    @property
    def num_q_blocks(self) -> int:
        return self.rows_padded // self.block_q

    @property
    def num_k_blocks(self) -> int:
        return self.keys_padded // self.block_k


def make_layout(q_shape, k_shape, blocks: RaggedBlocks) -> Layout:
    tokens, q_heads, head_dim = q_shape
    keys, kv_heads, _ = k_shape
    groups = q_heads // kv_heads
    rows = tokens * groups
    block_q = rows if rows <= blocks.q else blocks.q
    block_k = keys if keys <= blocks.k else blocks.k
    return Layout(
        kv_heads=kv_heads,
        groups=groups,
        rows=rows,
        rows_padded=_round_up(rows, block_q),
        block_q=block_q,
        keys=keys,
        keys_padded=_round_up(keys, block_k),
        block_k=block_k,
        head_dim=head_dim,
    )


def blocks_problem(q_shape, k_shape, dtype, blocks: RaggedBlocks, *, interpret: bool) -> str | None:
    """Why ``blocks`` cannot tile these shapes on a TPU, or None (interpret mode takes any)."""
    if blocks.q < 1 or blocks.k < 1:
        return f"blocks must be positive, got block_q={blocks.q}, block_k={blocks.k}"
    if interpret:
        return None
    layout = make_layout(q_shape, k_shape, blocks)
    if layout.block_q != layout.rows and layout.block_q % sublanes(dtype):
        return (
            f"block_q={blocks.q} must be a multiple of {sublanes(dtype)} for "
            f"{jnp.dtype(dtype).name} (or cover all {layout.rows} query rows)"
        )
    if layout.block_k != layout.keys and layout.block_k % LANES:
        return f"block_k={blocks.k} must be a multiple of {LANES} (or cover all {layout.keys} keys)"
    return None


def _block_spans(meta: masking.TokenMeta, cu_k, spec: RaggedSpec, layout: Layout):
    """(first kv block, number of kv blocks) each q block visits, int32 [num_q_blocks]."""
    first, last = masking.key_span(meta, cu_k, spec)
    first = jnp.repeat(first, layout.groups)
    last = jnp.repeat(last, layout.groups)
    pad = layout.rows_padded - layout.rows
    first = jnp.pad(first, (0, pad), constant_values=jnp.iinfo(jnp.int32).max)
    last = jnp.pad(last, (0, pad), constant_values=-1)
    first = first.reshape(layout.num_q_blocks, layout.block_q)
    last = last.reshape(layout.num_q_blocks, layout.block_q)
    visible = last >= first
    lo_key = jnp.min(jnp.where(visible, first, jnp.iinfo(jnp.int32).max), axis=1)
    hi_key = jnp.max(jnp.where(visible, last, -1), axis=1)
    any_visible = jnp.any(visible, axis=1)
    lo = jnp.where(any_visible, lo_key // layout.block_k, 0)
    count = jnp.where(any_visible, hi_key // layout.block_k - lo + 1, 0)
    return lo.astype(jnp.int32), count.astype(jnp.int32)


def _dot(a, b, contract_a: int, contract_b: int):
    acc = jnp.promote_types(a.dtype, jnp.float32)
    precision = jax.lax.Precision.HIGHEST if jnp.dtype(a.dtype).itemsize >= 4 else None
    return jax.lax.dot_general(
        a,
        b,
        (((contract_a,), (contract_b,)), ((), ())),
        preferred_element_type=acc,
        precision=precision,
    )


def _kernel(
    lo_ref,
    count_ref,  # scalar prefetch
    q_ref,
    k_ref,
    v_ref,
    q_seq_ref,
    q_pos_ref,
    k_seq_ref,
    k_pos_ref,
    sink_ref,
    ks_ref,
    vs_ref,
    o_ref,
    m_ref,
    l_ref,
    acc_ref,
    *,
    spec: RaggedSpec,
):
    qi, ki = pl.program_id(0), pl.program_id(1)

    @pl.when(ki == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, _MASK_VALUE, m_ref.dtype)
        l_ref[...] = jnp.zeros(l_ref.shape, l_ref.dtype)
        acc_ref[...] = jnp.zeros(acc_ref.shape, acc_ref.dtype)

    @pl.when(ki < count_ref[qi])
    def _step():
        ok = masking.allowed(q_seq_ref[...], q_pos_ref[...], k_seq_ref[...], k_pos_ref[...], spec)
        dtype = q_ref.dtype

        def scales(ref, h):  # [1, block_k] per-key scales of head h (1 for unquantized K/V)
            return 1.0 if ref is None else ref[h : h + 1, :].astype(m_ref.dtype)

        # [block_k, D]; 8-bit blocks converted whole (see pallas_paged), per head: converting
        # k and v once per step keeps both whole blocks live, over v4's VMEM at b64 x 2k fp8
        def head(ref, h):
            return ref[:, h, :] if ks_ref is None else ref[...].astype(dtype)[:, h, :]

        for h in range(k_ref.shape[1]):
            s = _dot(q_ref[h], head(k_ref, h), 1, 1) * scales(ks_ref, h)
            s = s * spec.scale
            if spec.softcap is not None:
                s = spec.softcap * jnp.tanh(s / spec.softcap)
            m_prev = m_ref[h]
            m_new = jnp.maximum(
                m_prev, jnp.max(jnp.where(ok, s, _MASK_VALUE), axis=1, keepdims=True)
            )
            alpha = jnp.exp(m_prev - m_new)
            p = jnp.where(ok, jnp.exp(s - m_new), 0.0)
            l_ref[h] = alpha * l_ref[h] + jnp.sum(p, axis=1, keepdims=True)
            v = head(v_ref, h)
            pv = _dot((p * scales(vs_ref, h)).astype(dtype), v, 1, 0)
            acc_ref[h] = alpha * acc_ref[h] + pv
            m_ref[h] = m_new

    @pl.when(ki == pl.num_programs(1) - 1)
    def _finish():
        m, total, acc = m_ref[...], l_ref[...], acc_ref[...]
        if sink_ref is not None:
            sink = sink_ref[...].astype(m.dtype)
            m_all = jnp.maximum(m, sink)
            scale = jnp.exp(m - m_all)
            total = total * scale + jnp.exp(sink - m_all)
            acc = acc * scale
        seen = total > 0
        inverse = jnp.where(seen, 1.0 / jnp.where(seen, total, 1.0), 0.0)
        o_ref[...] = (acc * inverse).astype(o_ref.dtype)


def _pack_rows(x, layout: Layout):
    """[T, Hq, ...] -> [Hkv, rows_padded, ...] with row t * G + g."""
    tokens = x.shape[0]
    x = x.reshape(tokens, layout.kv_heads, layout.groups, *x.shape[2:])
    x = jnp.moveaxis(x, 1, 0).reshape(layout.kv_heads, layout.rows, *x.shape[3:])
    pad = layout.rows_padded - layout.rows
    return jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)) if pad else x


def _unpack_rows(x, layout: Layout, tokens: int):
    x = x[:, : layout.rows].reshape(layout.kv_heads, tokens, layout.groups, *x.shape[2:])
    return jnp.moveaxis(x, 0, 1).reshape(tokens, layout.kv_heads * layout.groups, *x.shape[3:])


def _row_meta(values, layout: Layout, fill: int):
    """Per-token int32 [T] -> per-row [rows_padded, 1]."""
    rows = jnp.repeat(values, layout.groups)
    pad = layout.rows_padded - layout.rows
    return jnp.pad(rows, (0, pad), constant_values=fill)[:, None]


def _key_meta(values, layout: Layout, fill: int):
    pad = layout.keys_padded - layout.keys
    return jnp.pad(values, (0, pad), constant_values=fill)[None, :]


def _cost(layout: Layout, itemsize: int, kv_itemsize: int, quantized: bool) -> pl.CostEstimate:
    # An upper bound: every row against every key (the spans actually visited are data).
    pairs = layout.kv_heads * layout.rows_padded * layout.keys_padded
    per_key = 2 * layout.kv_heads * (layout.head_dim * kv_itemsize + 4 * quantized)
    return pl.CostEstimate(
        flops=4 * pairs * layout.head_dim,
        transcendentals=pairs,
        bytes_accessed=2 * layout.rows_padded * layout.kv_heads * layout.head_dim * itemsize
        + layout.keys_padded * per_key,
    )


def ragged_attention(
    q,
    k,
    v,
    cu_q,
    cu_k,
    sinks,
    spec: RaggedSpec,
    blocks: RaggedBlocks,
    interpret: bool,
    k_scales=None,
    v_scales=None,
):
    """[T, Hq, D] for q [T, Hq, D], k/v [N, Hkv, D], cu_q/cu_k [S+1], sinks [Hq] or None;
    ``k_scales``/``v_scales`` f32 [Hkv, N] with 8-bit k/v, else None."""
    tokens = q.shape[0]
    layout = make_layout(q.shape, k.shape, blocks)
    meta = masking.token_meta(cu_q, cu_k, tokens, k.shape[0])
    lo, count = _block_spans(meta, cu_k, spec, layout)
    acc = jnp.promote_types(q.dtype, jnp.float32)
    bq, bk, d = layout.block_q, layout.block_k, layout.head_dim

    def key_block(qi, ki, lo_ref, count_ref):
        return lo_ref[qi] + jnp.minimum(ki, jnp.maximum(count_ref[qi] - 1, 0))

    heads = layout.kv_heads
    rows_spec = pl.BlockSpec((heads, bq, d), lambda qi, ki, lo, n: (0, qi, 0))
    keys_spec = pl.BlockSpec((bk, heads, d), lambda qi, ki, lo, n: (key_block(qi, ki, lo, n), 0, 0))
    row_meta_spec = pl.BlockSpec((bq, 1), lambda qi, ki, lo, n: (qi, 0))
    key_meta_spec = pl.BlockSpec((1, bk), lambda qi, ki, lo, n: (0, key_block(qi, ki, lo, n)))
    sink_spec = pl.BlockSpec((heads, bq, 1), lambda qi, ki, lo, n: (0, qi, 0))

    def pad_keys(x):
        pad = layout.keys_padded - layout.keys
        return jnp.pad(x, [(0, pad), (0, 0), (0, 0)]) if pad else x

    operands = [
        _pack_rows(q, layout),
        pad_keys(k),
        pad_keys(v),
        _row_meta(meta.q_seq, layout, masking.PAD_QUERY),
        _row_meta(meta.q_pos, layout, 0),
        _key_meta(meta.k_seq, layout, masking.PAD_KEY),
        _key_meta(meta.k_pos, layout, 0),
    ]
    in_specs = [
        rows_spec,
        keys_spec,
        keys_spec,
        row_meta_spec,
        row_meta_spec,
        key_meta_spec,
        key_meta_spec,
    ]
    if sinks is not None:
        sink_rows = jnp.broadcast_to(sinks.astype(acc)[None, :], (tokens, sinks.shape[0]))
        operands.append(_pack_rows(sink_rows[..., None], layout))
        in_specs.append(sink_spec)
    quantized = k_scales is not None
    if quantized:
        pad = layout.keys_padded - layout.keys
        scale_spec = pl.BlockSpec((heads, bk), lambda qi, ki, lo, n: (0, key_block(qi, ki, lo, n)))
        operands += [jnp.pad(x, [(0, 0), (0, pad)]) if pad else x for x in (k_scales, v_scales)]
        in_specs += [scale_spec, scale_spec]

    def kernel(lo_ref, count_ref, *refs):
        inputs, outputs = refs[: len(in_specs)], refs[len(in_specs) :]
        extra = list(inputs[7:])
        sink_ref = extra.pop(0) if sinks is not None else None
        ks_ref, vs_ref = extra if quantized else (None, None)
        _kernel(lo_ref, count_ref, *inputs[:7], sink_ref, ks_ref, vs_ref, *outputs, spec=spec)

    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(layout.num_q_blocks, layout.num_k_blocks),
            in_specs=in_specs,
            out_specs=rows_spec,
            scratch_shapes=[
                pltpu.VMEM((heads, bq, 1), acc),
                pltpu.VMEM((heads, bq, 1), acc),
                pltpu.VMEM((heads, bq, d), acc),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct((layout.kv_heads, layout.rows_padded, d), q.dtype),
        compiler_params=tiling.compiler_params("parallel", "arbitrary"),
        cost_estimate=_cost(
            layout, jnp.dtype(q.dtype).itemsize, jnp.dtype(k.dtype).itemsize, quantized
        ),
        interpret=interpret,
        name="ragged_attention",
    )(lo, count, *operands)
    return _unpack_rows(out, layout, tokens)
