"""Which (query, key) pairs attend in a ragged batch: the one rule every implementation shares.

A ragged batch packs ``S`` sequences into one row: sequence ``s`` owns queries
``cu_q[s]:cu_q[s+1]`` and keys ``cu_k[s]:cu_k[s+1]``. Its queries are the LAST ``q_len_s`` tokens
of its ``k_len_s`` keys (KV-cache decode and chunked prefill): query ``i`` sits at key position
``i + k_len_s - q_len_s``. With ``causal`` a query sees keys at or before its position; a
``sliding_window`` ``w`` keeps keys with ``0 <= position - key < w`` (``|position - key| < w``
when not causal). Tokens past ``cu_q[S]`` / ``cu_k[S]`` are padding: no sequence owns them and
their output is zero, as is the output of a query that sees no key. Zero-length sequences
(``cu[s] == cu[s+1]``) are allowed, which is how a batch is padded to more sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from .options import RaggedSpec

PAD_QUERY = -1
"""Sequence id of padded query tokens."""
PAD_KEY = -2
"""Sequence id of padded keys: equal to no query's id, padded queries' included."""


def token_sequences(cu_seq_lens, num_tokens: int, pad_id: int):
    """(sequence id, index within the sequence) of each of ``num_tokens`` packed tokens."""
    token = jnp.arange(num_tokens, dtype=jnp.int32)
    cu = cu_seq_lens.astype(jnp.int32)
    seq = jnp.searchsorted(cu, token, side="right").astype(jnp.int32) - 1
    inside = token < cu[-1]
    seq = jnp.where(inside, jnp.clip(seq, 0, cu.shape[0] - 2), pad_id)
    start = cu[jnp.clip(seq, 0, cu.shape[0] - 2)]
    return seq, token - start


@dataclass(frozen=True)
class TokenMeta:
    """Per-token sequence ids and key positions of one ragged batch (int32 arrays)."""

    q_seq: jax.Array
    q_pos: jax.Array
    """Key position of each query: its index + k_len_s - q_len_s."""
    k_seq: jax.Array
    k_pos: jax.Array


def token_meta(cu_q, cu_k, num_queries: int, num_keys: int) -> TokenMeta:
    q_seq, q_index = token_sequences(cu_q, num_queries, PAD_QUERY)
    k_seq, k_pos = token_sequences(cu_k, num_keys, PAD_KEY)
    k_lens = jnp.diff(cu_k.astype(jnp.int32))
    q_lens = jnp.diff(cu_q.astype(jnp.int32))
    owner = jnp.clip(q_seq, 0, k_lens.shape[0] - 1)
    q_pos = q_index + k_lens[owner] - q_lens[owner]
    return TokenMeta(q_seq, q_pos, k_seq, k_pos)


def allowed(q_seq, q_pos, k_seq, k_pos, spec: RaggedSpec):
    """Boolean (broadcasting) array: may a query see a key?"""
    ok = (q_seq == k_seq) & (q_seq >= 0)
    if spec.causal:
        ok &= k_pos <= q_pos
    if spec.sliding_window is not None:
        distance = q_pos - k_pos
        if spec.causal:
            ok &= distance < spec.sliding_window
        else:
            ok &= jnp.abs(distance) < spec.sliding_window
    return ok


def key_span(meta: TokenMeta, cu_k, spec: RaggedSpec):
    """(first, last) packed key index each query may see; last < first when it sees none."""
    cu = cu_k.astype(jnp.int32)
    seq = jnp.clip(meta.q_seq, 0, cu.shape[0] - 2)
    start, end = cu[seq], cu[seq + 1]
    first = start
    last = end - 1
    if spec.causal:
        last = jnp.minimum(last, start + meta.q_pos)
    if spec.sliding_window is not None:
        first = jnp.maximum(first, start + meta.q_pos - spec.sliding_window + 1)
        if not spec.causal:
            last = jnp.minimum(last, start + meta.q_pos + spec.sliding_window - 1)
    empty = meta.q_seq < 0
    return jnp.where(empty, 0, first), jnp.where(empty, -1, last)
