"""Context parallelism: ring attention over a ``cp`` mesh axis, built on ``attention_with_lse``.

The sequence of q, k and v is split over the axis. Each shard keeps its query block and passes
its key/value block (and key segment ids) around the ring (``ppermute`` to the next shard, one
step per shard); every step attends its queries to the block it holds and merges the partial
result into a running one by the log-sum-exp of the scores (``logaddexp`` of the LSEs, outputs
reweighted). The backward is the transpose of this program: the kernel's own backward per block
(its LSE cotangent included) and the reverse ring.

Layouts of the sequence over the ``n`` shards:

* ``contiguous``: shard ``i`` holds chunk ``i`` of ``n``. A causal ring skips blocks wholly in the
  future, so the last shard does ``n`` times the first one's work.
* ``zigzag``: the sequence is cut into ``2n`` chunks and shard ``i`` holds chunks ``i`` and
  ``2n-1-i`` (``zigzag_order`` permutes a sequence into this layout; the caller permutes once, at
  the embedding, since every token-wise layer is indifferent to the order). With causal masking
  every shard then does the same work at every step: the local causal block at step 0, after
  that either both query chunks against the first key chunk (the sender is earlier in the ring)
  or the second query chunk against both key chunks (it is later). ``block_counts`` derives each
  shard's kernel block computations from the same schedule and the kernel's causal block skipping.

A ``sliding_window`` runs every step as one kernel call with the chunks' global token positions
(``q_positions`` / ``kv_positions``: the kernel applies the causal and window rule to them and
skips the block pairs they rule out); a step whose chunk pair is wholly outside the window (or
in the causal future) is skipped (``lax.cond``) without a kernel call, and steps skipped on
every shard are not run at all: the key/value blocks hop past them in one ``ppermute``
(``window_steps``; a contiguous causal ring with a window under one chunk runs 2 steps).
``block_counts`` counts those steps and blocks the same way.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from kernel_hub.kernel_api import (
    KernelInputError,
    find_mesh,
    option_values,
    partition_spec,
    require,
    shard_map_all,
)

from . import api, masking
from .options import AttentionSpec

OP = "ring_attention"
LAYOUTS = ("contiguous", "zigzag")
# Per-step work kinds. contiguous: skip / full / diagonal (causal) block; zigzag after step 0:
# both query chunks x the first key chunk (PAST) or the second query chunk x both (FUTURE).
_SKIP, _FULL, _DIAGONAL, _PAST, _FUTURE = range(5)


def step_kind(me, source, step: int, *, causal: bool, layout: str):
    """What shard ``me`` computes at ``step`` against the key block shard ``source`` sent
    (ints or traced ints); the one schedule the ring and ``block_counts`` share."""
    if not causal:
        return jnp.asarray(_FULL) if isinstance(me, jax.Array) else _FULL
    if layout == "zigzag":
        if step == 0:
            return _DIAGONAL
        return (
            jnp.where(source < me, _PAST, _FUTURE)
            if isinstance(me, jax.Array)
            else (_PAST if source < me else _FUTURE)
        )
    if isinstance(me, jax.Array):
        return jnp.where(source > me, _SKIP, jnp.where(source == me, _DIAGONAL, _FULL))
    return _SKIP if source > me else _DIAGONAL if source == me else _FULL


def _merge(out, lse, block_out, block_lse):
    """Two partial attentions over disjoint key sets combined into one (f32)."""
    total = jnp.logaddexp(lse, block_lse)
    safe = jnp.where(jnp.isneginf(total), 0.0, total)
    weight = jnp.where(jnp.isneginf(lse), 0.0, jnp.exp(lse - safe))[..., None]
    block_weight = jnp.where(jnp.isneginf(block_lse), 0.0, jnp.exp(block_lse - safe))[..., None]
    return out * weight + block_out.astype(jnp.float32) * block_weight, total


def _calls(kind: int, length: int):
    """The kernel calls of one step as (query slice, key slice, causal) over the local blocks."""
    half = length // 2
    whole = slice(0, length)
    return {
        _SKIP: [],
        _FULL: [(whole, whole, False)],
        _DIAGONAL: [(whole, whole, True)],
        _PAST: [(whole, slice(0, half), False)],
        _FUTURE: [(slice(half, length), whole, False)],
    }[kind]


def chunk_spans(shard, length: int, shards: int, layout: str) -> list[tuple]:
    """(first, last) global positions of each contiguous chunk shard ``shard`` (int or traced)
    holds, ``length`` tokens per shard."""
    if layout == "zigzag":
        half = length // 2
        firsts = (shard * half, (2 * shards - 1 - shard) * half)
        return [(first, first + half - 1) for first in firsts]
    return [(shard * length, shard * length + length - 1)]


def chunk_positions(shard, length: int, shards: int, layout: str) -> jax.Array:
    """The global positions [length] of the tokens shard ``shard`` holds, in its order."""
    spans = chunk_spans(shard, length, shards, layout)
    size = length // len(spans)
    return jnp.concatenate([first + jnp.arange(size, dtype=jnp.int32) for first, _ in spans])


def window_meets(q_span, k_span, *, causal: bool, window: int):
    """Whether some query in ``q_span`` sees some key in ``k_span`` (ints or traced ints) under
    the rule ``0 <= q - k < window`` (causal) or ``|q - k| < window``."""
    lowest, highest = q_span[0] - k_span[1], q_span[1] - k_span[0]  # of q - k
    floor = 0 if causal else 1 - window
    return (lowest <= window - 1) & (highest >= floor)


def _spans_meet(q_spans, k_spans, *, causal: bool, window: int):
    meets = [window_meets(a, b, causal=causal, window=window) for a in q_spans for b in k_spans]
    return functools.reduce(lambda x, y: x | y, meets)


def _windowed_ring(q, k, v, q_ids, kv_ids, *, axis, causal, layout, window, options):
    """The per-shard body under a sliding window: each step one kernel call on global
    positions, skipped when its chunk pair is wholly outside the window."""
    shards, me = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
    batch, heads, length, _ = q.shape
    out = jnp.zeros((*q.shape[:3], v.shape[-1]), jnp.float32)
    lse = jnp.full((batch, heads, length), -jnp.inf, jnp.float32)
    per_batch = lambda positions: jnp.broadcast_to(positions[None], (batch, length))
    q_positions = per_batch(chunk_positions(me, length, shards, layout))
    rule = option_values(dataclasses.replace(options, causal=causal, sliding_window=window))

    def attend(q, k, v, q_ids, kv_ids, kv_positions):
        return api.dot_product_attention_with_lse(
            q, k, v, None, q_ids, kv_ids, None, q_positions, kv_positions, **rule
        )

    def skip(*_):
        return jnp.zeros(out.shape, q.dtype), jnp.full(lse.shape, -jnp.inf, jnp.float32)

    q_spans = chunk_spans(me, length, shards, layout)
    moved = 0  # ring steps the key/value blocks have travelled
    for step in window_steps(length, shards, layout, causal=causal, window=window):
        if step > moved:  # the steps in between meet on no shard: one hop over all of them
            hop = [(i, (i + step - moved) % shards) for i in range(shards)]
            k, v, kv_ids = jax.lax.ppermute((k, v, kv_ids), axis, hop)
            moved = step
        source = (me - step) % shards
        kv_positions = per_batch(chunk_positions(source, length, shards, layout))
        operands = (q, k, v, q_ids, kv_ids, kv_positions)
        if step == 0:  # the shard's own chunks: the diagonal always meets
            block_out, block_lse = attend(*operands)
        else:
            k_spans = chunk_spans(source, length, shards, layout)
            meets = _spans_meet(q_spans, k_spans, causal=causal, window=window)
            block_out, block_lse = jax.lax.cond(meets, attend, skip, *operands)
        out, lse = _merge(out, lse, block_out, block_lse)
    return out.astype(q.dtype), lse


def window_steps(length: int, shards: int, layout: str, *, causal: bool, window: int) -> list:
    """The ring steps (0 = the shard's own block) at which some shard's chunks meet the block it
    holds under the window; the others are never run (nor sent: the blocks hop past them)."""
    return [
        step
        for step in range(shards)
        if step == 0
        or any(
            _spans_meet(
                chunk_spans(me, length, shards, layout),
                chunk_spans((me - step) % shards, length, shards, layout),
                causal=causal,
                window=window,
            )
            for me in range(shards)
        )
    ]


def _ring(q, k, v, q_ids, kv_ids, *, axis, causal, layout, options):
    """The per-shard body: local query block, key/value blocks arriving around the ring."""
    shards, me = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
    batch, heads, length, _ = q.shape
    out = jnp.zeros((*q.shape[:3], v.shape[-1]), jnp.float32)
    lse = jnp.full((batch, heads, length), -jnp.inf, jnp.float32)
    # The kinds a traced step may take (a switch compiles every branch's kernels).
    kinds = (_PAST, _FUTURE) if layout == "zigzag" else (_SKIP, _FULL, _DIAGONAL)

    def branch(kind):
        def run(q, k, v, q_ids, kv_ids):
            block_out = jnp.zeros(out.shape, q.dtype)
            block_lse = jnp.full(lse.shape, -jnp.inf, jnp.float32)
            for rows, cols, diagonal in _calls(kind, length):
                ids = (None, None) if q_ids is None else (q_ids[:, rows], kv_ids[:, cols])
                part_out, part_lse = api.dot_product_attention_with_lse(
                    q[:, :, rows],
                    k[:, :, cols],
                    v[:, :, cols],
                    None,
                    *ids,
                    **option_values(dataclasses.replace(options, causal=diagonal)),
                )
                block_out = block_out.at[:, :, rows].set(part_out)
                block_lse = block_lse.at[:, :, rows].set(part_lse)
            return block_out, block_lse

        return run

    branches = [branch(kind) for kind in kinds]
    ring = [(i, (i + 1) % shards) for i in range(shards)]
    for step in range(shards):
        source = (me - step) % shards  # whose key/value block this shard holds now
        kind = step_kind(me, source, step, causal=causal, layout=layout)
        if isinstance(kind, int):
            block_out, block_lse = branch(kind)(q, k, v, q_ids, kv_ids)
        else:
            index = kind - kinds[0]
            block_out, block_lse = jax.lax.switch(index, branches, q, k, v, q_ids, kv_ids)
        out, lse = _merge(out, lse, block_out, block_lse)
        if step + 1 < shards:
            k, v, kv_ids = jax.lax.ppermute((k, v, kv_ids), axis, ring)
    return out.astype(q.dtype), lse


def _split_axes(q, axis: str, explicit: bool):
    """Per-dimension mesh axes: batch and heads as q has them (Explicit) or unsplit, the
    sequence over ``axis``, head_dim whole."""
    if not explicit:
        return ((), (), (axis,), ())
    spec = tuple(jax.typeof(q).sharding.spec) + (None,) * 4
    as_axes = lambda e: () if e is None else (e,) if isinstance(e, str) else tuple(e)
    return (as_axes(spec[0]), as_axes(spec[1]), (axis,), ())


def zigzag_order(length: int, shards: int) -> np.ndarray:
    """Positions in zig-zag order: ``x[..., zigzag_order(S, n), :]`` lays a sequence out so
    that shard ``i`` of ``n`` holds chunks ``i`` and ``2n-1-i``; ``np.argsort`` of it undoes it."""
    require(
        length % (2 * shards) == 0,
        f"{OP}: a zig-zag layout cuts the sequence into 2 x {shards} chunks; length {length} "
        f"must divide by {2 * shards}",
    )
    chunks = np.arange(length).reshape(2 * shards, -1)
    return np.concatenate([np.concatenate([chunks[i], chunks[-1 - i]]) for i in range(shards)])


def block_counts(
    length: int,
    *,
    shards: int,
    causal: bool,
    layout: str,
    block_q: int,
    block_k: int,
    sliding_window: int | None = None,
) -> list[int]:
    """Kernel block computations (q block x kv block pairs the kernel does not skip) per shard
    over the whole ring, from the ring's schedule (``step_kind``; ``window_steps`` and the
    per-shard skip under a window) and the kernel's block skipping (``masking.key_range``; on
    positions, their blocks' ranges: what ``pallas_tpu`` visits)."""
    local = length // shards
    if sliding_window is not None:
        return _window_block_counts(local, shards, layout, causal, sliding_window, block_q, block_k)
    counts = []
    for me in range(shards):
        total = 0
        for step in range(shards):
            kind = step_kind(me, (me - step) % shards, step, causal=causal, layout=layout)
            for rows, cols, diagonal in _calls(kind, local):
                q_len, kv_len = rows.stop - rows.start, cols.stop - cols.start
                spec = masking.AttentionSpec(causal=diagonal)
                for first in range(0, q_len, block_q):
                    last = min(first + block_q, q_len) - 1
                    lo, hi = masking.key_range(first, last, q_len, kv_len, spec)
                    lo, hi = int(lo), int(hi)
                    if hi >= lo:
                        total += hi // block_k - lo // block_k + 1
        counts.append(total)
    return counts


def _window_block_counts(local, shards, layout, causal, window, block_q, block_k):
    def spans(shard, block):
        positions = np.asarray(chunk_positions(shard, local, shards, layout))
        return [
            (int(positions[i : i + block].min()), int(positions[i : i + block].max()))
            for i in range(0, local, block)
        ]

    meets = functools.partial(window_meets, causal=causal, window=window)
    counts = []
    for me in range(shards):
        q_blocks, total = spans(me, block_q), 0
        for step in window_steps(local, shards, layout, causal=causal, window=window):
            source = (me - step) % shards
            mine, held = (chunk_spans(s, local, shards, layout) for s in (me, source))
            if step and not _spans_meet(mine, held, causal=causal, window=window):
                continue
            total += sum(meets(q, k) for q in q_blocks for k in spans(source, block_k))
        counts.append(int(total))
    return counts


def ring_attention_with_lse(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    *,
    causal: bool = False,
    sliding_window: int | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    layout: str = "contiguous",
    axis: str = "cp",
    implementation: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """``dot_product_attention_with_lse`` with the sequence split over mesh axis ``axis``.

    q [B, Hq, S, D], k/v [B, Hkv, S, D] (same S: self-attention over the whole sequence), optional
    segment ids [B, S] (packed sequences), in ``layout`` order (see the module docstring); S must
    divide by the axis size (``zigzag``: twice it). Batch and heads may also be split (over other
    axes, as q has them on an Explicit mesh). ``sliding_window`` as in ``dot_product_attention``
    (positions are the tokens' places in the whole sequence).
    """
    api.check_inputs(query, key, value, None, q_segment_ids, kv_segment_ids)
    options = AttentionSpec(
        sliding_window=sliding_window, softcap=softcap, scale=scale, implementation=implementation
    )
    require(layout in LAYOUTS, f"{OP}: layout {layout!r}; valid: {LAYOUTS}")
    require(
        query.shape[2] == key.shape[2],
        f"{OP}: query and key sequence lengths differ ({query.shape[2]} vs {key.shape[2]}); "
        f"ring attention is self-attention over one sequence",
    )
    require(
        (q_segment_ids is None) == (kv_segment_ids is None),
        f"{OP}: pass both q_segment_ids and kv_segment_ids, or neither",
    )
    found = find_mesh(OP, (query, key, value))
    if found is None:
        raise KernelInputError(
            f"{OP}: needs a mesh with a {axis!r} axis: pass arrays sharded over a mesh, or call "
            f"inside kernel_hub.use_mesh(mesh)"
        )
    mesh, explicit = found
    require(axis in mesh.axis_names, f"{OP}: mesh axes {mesh.axis_names} have no {axis!r}")
    shards = mesh.shape[axis]
    chunks = shards * (2 if layout == "zigzag" else 1)
    require(
        query.shape[2] % chunks == 0,
        f"{OP}: sequence length {query.shape[2]} must divide by the {chunks} chunks of a "
        f"{layout} layout over the {shards} shards of {axis!r}",
    )
    q_axes = _split_axes(query, axis, explicit)
    kv_axes = (q_axes[0], q_axes[1], (axis,), ())
    ids_axes = (q_axes[0], (axis,))

    def body(q, k, v, *ids):
        q_ids, kv_ids = ids if ids else (None, None)
        where = dict(axis=axis, causal=causal, layout=layout, options=options)
        if sliding_window is None:
            return _ring(q, k, v, q_ids, kv_ids, **where)
        return _windowed_ring(q, k, v, q_ids, kv_ids, window=sliding_window, **where)

    arrays = (query, key, value)
    in_axes = [q_axes, kv_axes, kv_axes]
    if q_segment_ids is not None:
        arrays += (q_segment_ids, kv_segment_ids)
        in_axes += [ids_axes, ids_axes]
    out_specs = (partition_spec(q_axes), partition_spec(q_axes[:3]))
    return shard_map_all(body, mesh, arrays, in_axes, out_specs, explicit)


def ring_attention(query, key, value, *args, **options) -> jax.Array:
    """The output of ``ring_attention_with_lse``."""
    return ring_attention_with_lse(query, key, value, *args, **options)[0]
