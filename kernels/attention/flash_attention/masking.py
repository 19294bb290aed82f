"""Which (query, key) pairs attend: the one definition of the mask every implementation shares.

Queries are aligned to the END of the keys (query ``i`` of ``q_len`` sits at key position
``i + kv_len - q_len``), as with a KV cache in Transformers. With ``causal`` a query sees keys at or
before its position; a ``sliding_window`` of ``w`` keeps keys with ``0 <= position - key < w``
(causal) or ``|position - key| < w`` (bidirectional). Segment ids restrict attention to equal ids;
key padding is segment ``KV_PADDING_SEGMENT``, which no query id may use.

Per-token arrays (``TokenMask``, each [B, len], O(S)) describe what real batches need beyond that:
explicit ``positions`` replace the indices in the causal/window rule (a static cache prefilled
at an offset, empty cache slots), and ``groups`` >= 0 let tokens of one group see each other
whatever the rule says (bidirectional image-token blocks, prefix-LM):

    allowed = (rule(q position, k position) | (q group == k group >= 0)) & (q id == k id)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .options import AttentionSpec

KV_PADDING_SEGMENT = int(np.iinfo(np.int32).min)
"""Segment id given to padded keys; reserved (a query with this id would see padded keys)."""


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class TokenMask:
    """Per-token mask inputs, each an int32 [B, q_len] (``q_*``) or [B, kv_len] (``kv_*``) array,
    or None (see the module docstring). Pairs are given together or not at all."""

    q_segment_ids: Any = None
    kv_segment_ids: Any = None
    q_positions: Any = None
    kv_positions: Any = None
    q_groups: Any = None
    kv_groups: Any = None

    @property
    def has_segments(self) -> bool:
        return self.q_segment_ids is not None

    @property
    def has_positions(self) -> bool:
        return self.q_positions is not None

    @property
    def has_groups(self) -> bool:
        return self.q_groups is not None

    @property
    def empty(self) -> bool:
        return not (self.has_segments or self.has_positions or self.has_groups)


def block_rule(spec: AttentionSpec, tokens: TokenMask | None) -> AttentionSpec:
    """The static rule that bounds which blocks a kernel visits: the index rule of ``spec``,
    or none when positions or groups decide (they are data; blocks are then skipped on the
    data, see ``pallas_tpu``)."""
    if tokens is not None and (tokens.has_positions or tokens.has_groups):
        return replace(spec, causal=False, sliding_window=None)
    return spec


def window_allowed(q_position, k_position, spec: AttentionSpec):
    """The window alone: position - key < w (causal convention) or |position - key| < w."""
    distance = q_position - k_position
    allowed = jnp.ones(jnp.shape(distance), jnp.bool_)
    if spec.sliding_window is not None:
        if spec.causal:
            allowed &= distance < spec.sliding_window
        else:
            allowed &= jnp.abs(distance) < spec.sliding_window
    return allowed


def rule_allowed(q_position, k_position, spec: AttentionSpec):
    """The causal/window rule on positions (broadcasting int arrays)."""
    allowed = window_allowed(q_position, k_position, spec)
    if spec.causal:
        allowed &= q_position >= k_position
    return allowed


def position_allowed(q_index, k_index, q_len: int, kv_len: int, spec: AttentionSpec):
    """Boolean array: may query ``q_index`` see key ``k_index`` (broadcasting int arrays)?

    Keys at ``k_index >= kv_len`` (block padding) are never allowed.
    """
    return (k_index < kv_len) & rule_allowed(q_index + (kv_len - q_len), k_index, spec)


def token_allowed(q_position, k_position, spec: AttentionSpec, q_group=None, k_group=None):
    """The rule on explicit positions, widened by equal groups >= 0 (broadcasting)."""
    allowed = rule_allowed(q_position, k_position, spec)
    if q_group is not None:
        together = (q_group == k_group) & (q_group >= 0)
        if spec.window_bounds_groups:
            together &= window_allowed(q_position, k_position, spec)
        allowed |= together
    return allowed


def key_range(q_first, q_last, q_len: int, kv_len: int, spec: AttentionSpec, xp=jnp):
    """(first, last) key index any query in ``[q_first, q_last]`` may see; empty if last < first.
    ``xp``: jnp (traced block indices) or numpy (the host's cost count; a bound no rule sets
    stays a Python int)."""
    offset = kv_len - q_len
    first = 0
    last = kv_len - 1
    window = spec.sliding_window
    if window is not None:
        first = xp.maximum(first, q_first + offset - window + 1)
    if spec.causal:
        last = xp.minimum(last, q_last + offset)
    elif window is not None:
        last = xp.minimum(last, q_last + offset + window - 1)
    return first, last


def query_range(k_first, k_last, q_len: int, kv_len: int, spec: AttentionSpec, xp=jnp):
    """(first, last) query index that may see some key in ``[k_first, k_last]`` (inverse of
    ``key_range``); empty if last < first. ``xp`` as in ``key_range``."""
    offset = kv_len - q_len
    first = 0
    last = q_len - 1
    window = spec.sliding_window
    if spec.causal:
        first = xp.maximum(first, k_first - offset)
    elif window is not None:
        first = xp.maximum(first, k_first - offset - window + 1)
    if window is not None:
        last = xp.minimum(last, k_last - offset + window - 1)
    return first, last


def dense_mask(q_len: int, kv_len: int, spec: AttentionSpec, tokens: TokenMask | None = None):
    """[B or 1, 1, q_len, kv_len] boolean mask from the rule and the per-token arrays."""
    tokens = tokens or TokenMask()

    def rows(x):
        return None if x is None else x[:, None, :, None]

    def cols(x):
        return None if x is None else x[:, None, None, :]

    if tokens.has_positions or tokens.has_groups:
        q_position = rows(tokens.q_positions)
        k_position = cols(tokens.kv_positions)
        if q_position is None:
            q_position = (jnp.arange(q_len) + (kv_len - q_len))[None, None, :, None]
            k_position = jnp.arange(kv_len)[None, None, None, :]
        allowed = token_allowed(
            q_position, k_position, spec, rows(tokens.q_groups), cols(tokens.kv_groups)
        )
    else:
        allowed = position_allowed(
            jnp.arange(q_len)[:, None], jnp.arange(kv_len)[None, :], q_len, kv_len, spec
        )[None, None]
    if tokens.has_segments:
        allowed = allowed & (rows(tokens.q_segment_ids) == cols(tokens.kv_segment_ids))
    return allowed


def allowed_pairs(q_len: int, kv_len: int, spec: AttentionSpec) -> int:
    """How many (query, key) pairs the position rules allow (segments ignored): FLOP counting."""
    queries = np.arange(q_len)
    first, last = key_range(queries, queries, q_len, kv_len, spec, xp=np)
    return int(np.broadcast_to(np.maximum(last - first + 1, 0), queries.shape).sum())


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
