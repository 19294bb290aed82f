"""Plain jax.numpy ragged and paged attention: the numerics oracle and the XLA implementations.

Scores and softmax statistics are f32 (f64 for f64 inputs). The ragged form computes the full
[T, ΣKV] score matrix under the ragged mask, so it suits tests and small batches, not long
contexts; the paged form gathers each sequence's pages.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import kv_quant, masking
from .masking import RaggedSpec


def accumulation_dtype(dtype) -> jnp.dtype:
    return jnp.promote_types(dtype, jnp.float32)


def _softmax_attend(s, allowed, v, sinks, out_dtype):
    """softmax over the last axis of s [..., Hkv, G, Q, K] under ``allowed``, then @ v.

    ``sinks`` [Hkv, G] (or None) add exp(sink) to each row's denominator.
    """
    row_max = jnp.max(jnp.where(allowed, s, -jnp.inf), axis=-1, keepdims=True)
    if sinks is not None:
        row_max = jnp.maximum(row_max, sinks.astype(s.dtype)[..., None, None])
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    p = jnp.where(allowed, jnp.exp(jnp.where(allowed, s, row_max) - row_max), 0.0)
    total = jnp.sum(p, axis=-1, keepdims=True)
    if sinks is not None:
        total = total + jnp.exp(sinks.astype(s.dtype)[..., None, None] - row_max)
    p = p / jnp.where(total > 0, total, 1.0)
    return jnp.einsum(
        "...hgqk,...khd->...qhgd", p, v.astype(s.dtype), precision=jax.lax.Precision.HIGHEST
    ).astype(out_dtype)


def _scores(q, k, spec: RaggedSpec):
    """q [..., Q, Hkv, G, D], k [..., K, Hkv, D] -> [..., Hkv, G, Q, K] scaled, soft-capped."""
    acc = accumulation_dtype(q.dtype)
    s = jnp.einsum(
        "...qhgd,...khd->...hgqk",
        q,
        k,
        preferred_element_type=acc,
        precision=jax.lax.Precision.HIGHEST,
    ) * jnp.asarray(spec.scale, acc)
    if spec.softcap is not None:
        s = spec.softcap * jnp.tanh(s / spec.softcap)
    return s


def ragged_attention(q, k, v, cu_q, cu_k, sinks, spec: RaggedSpec, k_scales=None, v_scales=None):
    """[T, Hq, D] for q [T, Hq, D], k/v [N, Hkv, D], cu_q/cu_k [S+1], sinks [Hq] or None;
    8-bit k/v come with scales [Hkv, N] and are dequantized to q's dtype first."""
    if k_scales is not None:
        k = kv_quant.dequantize(k, k_scales.T, q.dtype)
        v = kv_quant.dequantize(v, v_scales.T, q.dtype)
    num_tokens, q_heads, head_dim = q.shape
    num_keys, kv_heads, _ = k.shape
    groups = q_heads // kv_heads
    meta = masking.token_meta(cu_q, cu_k, num_tokens, num_keys)
    s = _scores(q.reshape(num_tokens, kv_heads, groups, head_dim), k, spec)
    ok = masking.allowed(
        meta.q_seq[:, None], meta.q_pos[:, None], meta.k_seq[None, :], meta.k_pos[None, :], spec
    )
    grouped_sinks = None if sinks is None else sinks.reshape(kv_heads, groups)
    out = _softmax_attend(s, ok[None, None], v, grouped_sinks, q.dtype)
    return out.reshape(q.shape)


def gather_pages(pages, block_table):
    """[S, max_pages * page, Hkv, D] keys or values of each sequence, from [P, page, Hkv, D]
    pages; -1 entries read page 0 (masked out by the lengths)."""
    num_pages, page, kv_heads, head_dim = pages.shape
    seq_pages = pages[jnp.clip(block_table, 0, num_pages - 1)]  # [S, max_pages, page, Hkv, D]
    s, max_pages = block_table.shape
    return seq_pages.reshape(s, max_pages * page, kv_heads, head_dim)


def _token_scales(scales, block_table):
    """[S, max_pages * page, Hkv] per-token scales of each sequence, from [P, Hkv, page]."""
    return gather_pages(jnp.swapaxes(scales, 1, 2)[..., None], block_table)[..., 0]


def paged_attention(
    q, k_pages, v_pages, block_table, kv_lens, sinks, spec: RaggedSpec, k_scales=None, v_scales=None
):
    """[S, Hq, D] decode attention: the one query of sequence s sits at position kv_lens[s] - 1
    and reads keys 0..kv_lens[s]-1 from pages ``block_table[s]``; kv_lens[s] == 0 gives zeros.
    8-bit pages come with scales [P, Hkv, page] and are dequantized to q's dtype
    (``kv_quant.dequantize``) before the attention."""
    seqs, q_heads, head_dim = q.shape
    kv_heads = k_pages.shape[2]
    groups = q_heads // kv_heads
    k = gather_pages(k_pages, block_table)
    v = gather_pages(v_pages, block_table)
    if k_scales is not None:
        k = kv_quant.dequantize(k, _token_scales(k_scales, block_table), q.dtype)
        v = kv_quant.dequantize(v, _token_scales(v_scales, block_table), q.dtype)
    s = _scores(q.reshape(seqs, 1, kv_heads, groups, head_dim), k, spec)  # [S, Hkv, G, 1, K]
    key = jnp.arange(k.shape[1], dtype=jnp.int32)[None, :]
    lens = kv_lens.astype(jnp.int32)[:, None]
    position = lens - 1
    ok = (key < lens) & (key <= position)
    if spec.sliding_window is not None:
        ok &= position - key < spec.sliding_window
    grouped_sinks = None if sinks is None else sinks.reshape(kv_heads, groups)
    out = _softmax_attend(s, ok[:, None, None, None, :], v, grouped_sinks, q.dtype)
    return out.reshape(q.shape)
