"""Pallas paged decode attention for TPU, forward only, reading Transformers' cache pages in place.

Pages are one layer's page views of Transformers' cache, [P, page, Hkv, D]. A grid step DMAs
whole pages (every kv head) straight from the block table's page ids, and the kernel takes head
``h`` as the strided slice ``page[:, h, :]`` in VMEM: no gather, no transpose, no copy of the
cache.

Grid (sequence, page step). Each step reads ``pages_per_block`` pages, one BlockSpec per page
slot (the same pages array is passed once per slot). Steps start at the first page the sliding
window can see and stop after the sequence's last page; later steps repeat the last page's block
index, so they fetch nothing, and compute nothing. Each sequence has one query (the token just
written, at position ``kv_lens[s] - 1``); its Hq heads are one [Hq, D] block, kv head ``h``
serving rows ``h * G:(h + 1) * G``. ``kv_lens[s] == 0`` marks a padding sequence: zero output.

8-bit pages (``kv_quant``: float8_e4m3fn or int8, one f32 scale per token and kv head) come with
scale pages [P, Hkv, page] (lane-dense: a page's scales of one head are one row), fetched with
their pages. Each head's [page, D] slice is converted to q's dtype in VMEM (exact for both
formats) and its per-token scales are applied on the [G, page] side, which is the same product
with fewer multiplies: scores ``q . (s_t k_t) = (q . k_t) s_t``, and ``sum_t p_t (s_t v_t) =
sum_t (p_t s_t) v_t`` (the softmax denominator takes the unscaled ``p_t``). HBM traffic is one
byte per cached element plus 4 bytes per token and kv head.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernel_hub.kernel_api import tiling

from .masking import RaggedSpec
from .pallas_ragged import LANES, _dot, sublanes

_MASK_VALUE = -1e30


@dataclass(frozen=True)
class PagedBlocks:
    """``pages_per_block``: cache pages each grid step reads per kv head."""

    pages_per_block: int


def _cdiv(a, b):
    return (a + b - 1) // b


def blocks_problem(q_shape, pages_shape, dtype, blocks: PagedBlocks, *, interpret: bool):
    """Why the Pallas kernel cannot tile these shapes, or None (interpret mode takes any).
    ``dtype`` is the pages' dtype."""
    if blocks.pages_per_block < 1:
        return f"pages_per_block={blocks.pages_per_block} must be >= 1"
    if interpret:
        return None
    page = pages_shape[1]
    if page % sublanes(dtype):
        return (
            f"page_size={page} cannot be tiled: the kernel reads whole pages as "
            f"({sublanes(dtype)}, {LANES}) {jnp.dtype(dtype).name} tiles, so page_size must be a "
            f"multiple of {sublanes(dtype)}"
        )
    return None


def _first_page(length, page: int, spec: RaggedSpec):
    if spec.sliding_window is None:
        return jnp.zeros_like(length)
    return jnp.maximum(length - spec.sliding_window, 0) // page


def paged_attention(
    q,
    k_pages,
    v_pages,
    block_table,
    kv_lens,
    sinks,
    spec: RaggedSpec,
    blocks: PagedBlocks,
    interpret: bool,
    k_scales=None,
    v_scales=None,
):
    """[S, Hq, D] for q [S, Hq, D], pages [P, page, Hkv, D], block_table [S, max_pages] (-1 =
    unused), kv_lens [S] (keys per sequence, the new token included), sinks [Hq] or None;
    ``k_scales``/``v_scales`` [P, Hkv, page] f32 with 8-bit pages, else None."""
    seqs, q_heads, head_dim = q.shape
    _, page, kv_heads, _ = k_pages.shape
    groups = q_heads // kv_heads
    max_pages = block_table.shape[1]
    per_step = blocks.pages_per_block
    steps = _cdiv(max_pages, per_step)
    acc = jnp.promote_types(q.dtype, jnp.float32)
    table = block_table.astype(jnp.int32).reshape(-1)
    lengths = kv_lens.astype(jnp.int32)

    def page_index(s, j, slot, table_ref, lens_ref):
        length = lens_ref[s]
        first = _first_page(length, page, spec)
        last = jnp.maximum(_cdiv(length, page) - 1, first)
        index = jnp.minimum(first + j * per_step + slot, last)
        return jnp.maximum(table_ref[s * max_pages + index], 0)

    def page_spec(slot):
        return pl.BlockSpec(
            (None, page, kv_heads, head_dim),
            lambda s, j, t, n: (page_index(s, j, slot, t, n), 0, 0, 0),
        )

    def scale_spec(slot):
        return pl.BlockSpec(
            (None, kv_heads, page), lambda s, j, t, n: (page_index(s, j, slot, t, n), 0, 0)
        )

    quantized = k_scales is not None
    q_spec = pl.BlockSpec((None, q_heads, head_dim), lambda s, j, t, n: (s, 0, 0))
    in_specs = [q_spec] + [page_spec(i) for i in range(per_step)] * 2
    operands = [q] + [k_pages] * per_step + [v_pages] * per_step
    if quantized:
        in_specs += [scale_spec(i) for i in range(per_step)] * 2
        operands += [k_scales] * per_step + [v_scales] * per_step
    if sinks is not None:
        in_specs.append(pl.BlockSpec((q_heads, 1), lambda s, j, t, n: (0, 0)))
        operands.append(sinks.astype(acc).reshape(q_heads, 1))

    def kernel(table_ref, lens_ref, q_ref, *refs):
        k_refs, v_refs = refs[:per_step], refs[per_step : 2 * per_step]
        rest = refs[2 * per_step :]
        ks_refs = vs_refs = None
        if quantized:
            ks_refs, vs_refs = rest[:per_step], rest[per_step : 2 * per_step]
            rest = rest[2 * per_step :]
        sink_ref = rest[0] if sinks is not None else None
        o_ref, m_ref, l_ref, acc_ref = rest[-4:]
        s_id, j = pl.program_id(0), pl.program_id(1)
        length = lens_ref[s_id]
        first = _first_page(length, page, spec)
        pages_used = _cdiv(length, page) - first

        @pl.when(j == 0)
        def _init():
            m_ref[...] = jnp.full(m_ref.shape, _MASK_VALUE, m_ref.dtype)
            l_ref[...] = jnp.zeros(l_ref.shape, l_ref.dtype)
            acc_ref[...] = jnp.zeros(acc_ref.shape, acc_ref.dtype)

        def page_of(refs, slot):
            """This slot's [page, Hkv, D] keys or values in q's dtype, head h read as
            ``[:, h, :]``. An 8-bit page is converted whole, once per slot and step, then sliced
            per head (Mosaic cannot slice one head out of a packed int8 page on v6e)."""
            return refs[slot][...].astype(q.dtype) if quantized else refs[slot]

        def scales(scale_refs, slot, h):
            """[1, page]: head h's per-token scales of this slot's page (1 when unquantized)."""
            return scale_refs[slot][h : h + 1, :].astype(acc) if quantized else 1.0

        def attend(slot, offset):
            key = (first + offset) * page + jax.lax.broadcasted_iota(jnp.int32, (groups, page), 1)
            ok = key < length
            if spec.sliding_window is not None:
                ok &= key >= length - spec.sliding_window
            keys, values = page_of(k_refs, slot), page_of(v_refs, slot)
            for h in range(kv_heads):
                rows = slice(h * groups, (h + 1) * groups)
                s = _dot(q_ref[rows, :], keys[:, h, :], 1, 1)
                s = s * scales(ks_refs, slot, h) * spec.scale
                if spec.softcap is not None:
                    s = spec.softcap * jnp.tanh(s / spec.softcap)
                m_prev = m_ref[rows, :]
                m_new = jnp.maximum(
                    m_prev, jnp.max(jnp.where(ok, s, _MASK_VALUE), axis=1, keepdims=True)
                )
                alpha = jnp.exp(m_prev - m_new)
                p = jnp.where(ok, jnp.exp(s - m_new), 0.0)
                l_ref[rows, :] = alpha * l_ref[rows, :] + jnp.sum(p, axis=1, keepdims=True)
                v = values[:, h, :]
                pv = _dot((p * scales(vs_refs, slot, h)).astype(v.dtype), v, 1, 0)
                acc_ref[rows, :] = alpha * acc_ref[rows, :] + pv
                m_ref[rows, :] = m_new

        for slot in range(per_step):
            offset = j * per_step + slot
            pl.when(offset < pages_used)(functools.partial(attend, slot, offset))

        @pl.when(j == pl.num_programs(1) - 1)
        def _finish():
            m, total, out = m_ref[...], l_ref[...], acc_ref[...]
            if sink_ref is not None:
                sink = sink_ref[...]
                m_all = jnp.maximum(m, sink)
                rescale = jnp.exp(m - m_all)
                total = total * rescale + jnp.exp(sink - m_all)
                out = out * rescale
            seen = total > 0
            inverse = jnp.where(seen, 1.0 / jnp.where(seen, total, 1.0), 0.0)
            o_ref[...] = (out * inverse).astype(o_ref.dtype)

    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(seqs, steps),
            in_specs=in_specs,
            out_specs=q_spec,
            scratch_shapes=[
                pltpu.VMEM((q_heads, 1), acc),
                pltpu.VMEM((q_heads, 1), acc),
                pltpu.VMEM((q_heads, head_dim), acc),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=tiling.compiler_params("parallel", "arbitrary"),
        cost_estimate=cost(
            seqs, max_pages, page, q_heads, kv_heads, head_dim, q.dtype, k_pages.dtype, quantized
        ),
        interpret=interpret,
        name="paged_attention",
    )(table, lengths, *operands)
    return out


def cost(seqs, max_pages, page, q_heads, kv_heads, head_dim, q_dtype, page_dtype, quantized):
    """A hand count and an upper bound (the lengths are data): every table entry's page of K and
    V read once (with its scales when quantized), q read and the output written once."""
    keys = seqs * max_pages * page
    per_key = 2 * kv_heads * (head_dim * jnp.dtype(page_dtype).itemsize + 4 * quantized)
    return pl.CostEstimate(
        flops=4 * keys * q_heads * head_dim,
        transcendentals=keys * q_heads,
        bytes_accessed=keys * per_key + 2 * seqs * q_heads * head_dim * jnp.dtype(q_dtype).itemsize,
    )
