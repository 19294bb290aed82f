"""Chunk-aligned layout shared by the chunked implementations.

Each sequence is placed so it starts on a chunk boundary and is zero-padded to whole chunks; a
zero token (g = 0, beta = 0) leaves the state unchanged, so the padding changes neither outputs
nor final states. A batch ``[B, T, ...]`` pads T to a multiple of the chunk. A packed batch (B ==
1, ``cu_seqlens`` of N sequences) becomes one row of ``ceil(T / C) * C + N * C`` positions (a
static bound: every sequence gets at least one chunk, so a zero-length one keeps its initial
state). Per chunk the kernels read which sequence it belongs to and whether it starts it (then the
state is reset to that sequence's initial state); the final state of a sequence is the state after
its last chunk.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Plan(NamedTuple):
    """``source``: packed token index of each padded position (-1: padding), None for a batch;
    ``target``: padded position of each packed token, None for a batch; ``chunk_sequence`` and
    ``chunk_starts``: [B, chunks] int32 (sequence index, 1 where the chunk starts it)."""

    length: int
    source: jax.Array | None
    target: jax.Array | None
    chunk_sequence: jax.Array
    chunk_starts: jax.Array


def plan(batch: int, length: int, chunk: int, cu_seqlens: jax.Array | None) -> Plan:
    if cu_seqlens is None:
        padded = -(-length // chunk) * chunk
        chunks = padded // chunk
        sequence = jnp.broadcast_to(jnp.arange(batch, dtype=jnp.int32)[:, None], (batch, chunks))
        starts = jnp.broadcast_to((jnp.arange(chunks) == 0).astype(jnp.int32), (batch, chunks))
        return Plan(padded, None, None, sequence, starts)
    cu = cu_seqlens.astype(jnp.int32)
    sequences = cu.shape[0] - 1
    padded = -(-length // chunk) * chunk + sequences * chunk
    lengths = cu[1:] - cu[:-1]
    spans = jnp.maximum(1, -(-lengths // chunk)) * chunk
    begin = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(spans)[:-1]])
    position = jnp.arange(padded, dtype=jnp.int32)
    owner = jnp.clip(jnp.searchsorted(begin, position, side="right") - 1, 0, sequences - 1)
    offset = position - begin[owner]
    source = jnp.where(offset < lengths[owner], cu[owner] + offset, -1)
    token = jnp.arange(length, dtype=jnp.int32)
    token_owner = jnp.clip(jnp.searchsorted(cu[1:], token, side="right"), 0, sequences - 1)
    target = begin[token_owner] + token - cu[token_owner]
    chunk_first = position[::chunk]
    sequence = owner[::chunk].astype(jnp.int32)
    starts = (chunk_first == begin[sequence]).astype(jnp.int32)
    return Plan(padded, source, target, sequence[None], starts[None])


def to_chunks(x: jax.Array, p: Plan) -> jax.Array:
    """[B, T, H, ...] -> [B, H, L, ...] in the padded layout (zeros in the padding)."""
    if p.source is None:
        pad = [(0, 0), (0, p.length - x.shape[1])] + [(0, 0)] * (x.ndim - 2)
        x = jnp.pad(x, pad)
    else:
        gathered = jnp.take(x, jnp.maximum(p.source, 0), axis=1)
        valid = (p.source >= 0).reshape((1, -1) + (1,) * (x.ndim - 2))
        x = jnp.where(valid, gathered, jnp.zeros((), x.dtype))
    return jnp.moveaxis(x, 2, 1)


def from_chunks(y: jax.Array, p: Plan, length: int) -> jax.Array:
    """[B, H, L, ...] -> [B, T, H, ...]: the real tokens back in their places."""
    y = jnp.moveaxis(y, 1, 2)
    return y[:, :length] if p.target is None else jnp.take(y, p.target, axis=1)
