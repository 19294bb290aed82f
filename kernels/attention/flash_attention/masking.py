"""Which (query, key) pairs attend: the one definition of the mask every implementation shares.

Queries are aligned to the END of the keys (query ``i`` of ``q_len`` sits at key position
``i + kv_len - q_len``), as with a KV cache in Transformers. With ``causal`` a query sees keys at or
before its position; a ``sliding_window`` of ``w`` keeps keys with ``0 <= position - key < w``
(causal) or ``|position - key| < w`` (bidirectional). Segment ids restrict attention to equal ids;
key padding is segment ``KV_PADDING_SEGMENT``, which no query id may use.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

KV_PADDING_SEGMENT = int(np.iinfo(np.int32).min)
"""Segment id given to padded keys; reserved (a query with this id would see padded keys)."""


@dataclass(frozen=True)
class AttentionSpec:
    """Static attention options, resolved (``scale`` is a number, never None)."""

    causal: bool = False
    sliding_window: int | None = None
    softcap: float | None = None
    scale: float = 1.0


def position_allowed(q_index, k_index, q_len: int, kv_len: int, spec: AttentionSpec):
    """Boolean array: may query ``q_index`` see key ``k_index`` (broadcasting int arrays)?

    Keys at ``k_index >= kv_len`` (block padding) are never allowed.
    """
    position = q_index + (kv_len - q_len)
    allowed = k_index < kv_len
    if spec.causal:
        allowed &= k_index <= position
    if spec.sliding_window is not None:
        distance = position - k_index
        if spec.causal:
            allowed &= distance < spec.sliding_window
        else:
            allowed &= jnp.abs(distance) < spec.sliding_window
    return allowed


def key_range(q_first, q_last, q_len: int, kv_len: int, spec: AttentionSpec):
    """(first, last) key index any query in ``[q_first, q_last]`` may see; empty if last < first."""
    offset = kv_len - q_len
    first = 0
    last = kv_len - 1
    window = spec.sliding_window
    if window is not None:
        first = jnp.maximum(first, q_first + offset - window + 1)
    if spec.causal:
        last = jnp.minimum(last, q_last + offset)
    elif window is not None:
        last = jnp.minimum(last, q_last + offset + window - 1)
    return first, last


def query_range(k_first, k_last, q_len: int, kv_len: int, spec: AttentionSpec):
    """(first, last) query index that may see some key in ``[k_first, k_last]`` (inverse of
    ``key_range``); empty if last < first."""
    offset = kv_len - q_len
    first = 0
    last = q_len - 1
    window = spec.sliding_window
    if spec.causal:
        first = jnp.maximum(first, k_first - offset)
    elif window is not None:
        first = jnp.maximum(first, k_first - offset - window + 1)
    if window is not None:
        last = jnp.minimum(last, k_last - offset + window - 1)
    return first, last


def dense_mask(
    q_len: int, kv_len: int, spec: AttentionSpec, q_segment_ids=None, kv_segment_ids=None
):
    """[B or 1, 1, q_len, kv_len] boolean mask from positions and optional ids ([B, len])."""
    allowed = position_allowed(
        jnp.arange(q_len)[:, None], jnp.arange(kv_len)[None, :], q_len, kv_len, spec
    )[None, None]
    if q_segment_ids is not None:
        allowed = allowed & (q_segment_ids[:, None, :, None] == kv_segment_ids[:, None, None, :])
    return allowed


def allowed_pairs(q_len: int, kv_len: int, spec: AttentionSpec) -> int:
    """How many (query, key) pairs the position rules allow (segments ignored): FLOP counting."""
    position = np.arange(q_len)[:, None] + (kv_len - q_len)
    first = np.zeros_like(position)
    last = np.full_like(position, kv_len - 1)
    window = spec.sliding_window
    if window is not None:
        first = np.maximum(first, position - window + 1)
    if spec.causal:
        last = np.minimum(last, position)
    elif window is not None:
        last = np.minimum(last, position + window - 1)
    return int(np.maximum(last - first + 1, 0).sum())


def merge_key_padding(q_len: int, kv_len: int, batch: int, kv_mask, q_segment_ids, kv_segment_ids):
    """Fold a key padding mask ([B, kv_len], True = attend) into segment ids.

    Returns (q_segment_ids, kv_segment_ids), both None when neither padding nor segments are used.
    """
    if kv_mask is None:
        return q_segment_ids, kv_segment_ids
    if q_segment_ids is None:
        q_segment_ids = jnp.zeros((batch, q_len), jnp.int32)
        kv_segment_ids = jnp.zeros((batch, kv_len), jnp.int32)
    kv_segment_ids = jnp.where(kv_mask, kv_segment_ids, KV_PADDING_SEGMENT)
    return q_segment_ids, kv_segment_ids
