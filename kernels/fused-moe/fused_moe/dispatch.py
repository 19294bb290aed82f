"""Where each (token, slot) pair goes: the expert-sorted, chunk-padded row layout of the kernel.

The kernel walks experts in order and, for each, the expert's rows in chunks of ``tm``. Each
expert's rows start at a multiple of ``tm`` (its group is padded up to whole chunks), so every
chunk is an aligned slice. Only small int32/f32 vectors are built here (one entry per padded row:
its token and router weight); the token rows themselves are gathered by the kernel from
``hidden_states``, never copied into a ``[T * k, H]`` array.

Expert ids outside ``[0, E)`` (padding rows, expert-parallel sentinels) belong to no expert and
contribute nothing. A token's k ids must be distinct (top-k gives distinct ids): an expert then
receives at most ``T`` rows, which bounds the kernel's per-expert scratch.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Dispatch(NamedTuple):
    chunks: jax.Array
    """[E] int32: ``tm``-row chunks of each expert (0 for an expert without rows)."""
    offsets: jax.Array
    """[E] int32: first padded row of each expert (a multiple of ``tm``)."""
    weight_expert: jax.Array
    """[E] int32: whose weight blocks the grid steps of expert e fetch. An expert without rows
    names the last expert with rows before it (the first one if none), so its steps fetch blocks
    already in VMEM: its weights are never read from HBM."""
    weight_block: jax.Array
    """[E] int32: -1 (fetch block j of the step) or the fixed block an empty expert stays on."""
    row_tokens: jax.Array
    """[R, 1] int32: the token of each padded row, -1 for padding."""
    row_weights: jax.Array
    """[R, 1]: the router weight of each padded row (f32, f64 for f64 weights), 0 for padding."""


def cdiv(a, b: int):
    return (a + b - 1) // b


def padded_rows(tokens: int, top_k: int, num_experts: int, tm: int) -> int:
    """Static bound on the padded row count: every expert with rows wastes < ``tm`` rows."""
    pairs = tokens * top_k
    return cdiv(pairs + min(num_experts, pairs) * (tm - 1), tm) * tm


def dispatch(
    top_k_index: jax.Array, top_k_weights: jax.Array, num_experts: int, tm: int, blocks: int
) -> Dispatch:
    """The layout for ``top_k_index`` / ``top_k_weights`` [T, k]; ``blocks`` = grid steps per
    expert along the intermediate dimension."""
    tokens, top_k = top_k_index.shape
    rows = padded_rows(tokens, top_k, num_experts, tm)
    flat = top_k_index.reshape(-1).astype(jnp.int32)
    expert = jnp.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    counts = jnp.bincount(expert, length=num_experts + 1)[:num_experts].astype(jnp.int32)
    # A token's ids are distinct, so an expert has at most T rows; the clamp keeps a caller's
    # duplicate ids inside the kernel's scratch (the surplus rows are dropped, not written
    # out of bounds).
    chunks = jnp.minimum(cdiv(counts, tm), cdiv(tokens, tm)).astype(jnp.int32)
    padded = chunks * tm
    offsets = (jnp.cumsum(padded) - padded).astype(jnp.int32)
    starts = jnp.cumsum(counts) - counts

    order = jnp.argsort(expert, stable=True)
    sorted_expert = expert[order]
    clamped = jnp.minimum(sorted_expert, num_experts - 1)
    rank = jnp.arange(flat.shape[0], dtype=jnp.int32) - starts[clamped]
    keep = (sorted_expert < num_experts) & (rank < padded[clamped])
    dest = jnp.where(keep, offsets[clamped] + rank, rows)  # out of range: dropped
    row_tokens = (
        jnp.full((rows,), -1, jnp.int32)
        .at[dest]
        .set((order // top_k).astype(jnp.int32), mode="drop")
    )
    acc = jnp.promote_types(top_k_weights.dtype, jnp.float32)
    weights = top_k_weights.reshape(-1).astype(acc)[order]
    row_weights = jnp.zeros((rows,), acc).at[dest].set(weights, mode="drop")

    nonempty = chunks > 0
    index = jnp.arange(num_experts, dtype=jnp.int32)
    previous = jax.lax.cummax(jnp.where(nonempty, index, -1))
    first = jnp.argmax(nonempty).astype(jnp.int32)
    weight_expert = jnp.where(nonempty, index, jnp.where(previous >= 0, previous, first))
    weight_block = jnp.where(nonempty, -1, jnp.where(previous >= 0, blocks - 1, 0))
    return Dispatch(
        chunks,
        offsets,
        weight_expert.astype(jnp.int32),
        weight_block.astype(jnp.int32),
        row_tokens[:, None],
        row_weights[:, None],
    )
