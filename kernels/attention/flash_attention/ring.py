"""Context parallelism: ring attention over a ``cp`` mesh axis, built on ``attention_with_lse``.

The sequence of q, k and v is split over the axis. Each shard keeps its query block and passes
its key/value block around the ring (``ppermute`` to the next shard, one step per shard); every
step attends its queries to the block it holds and merges the partial result into a running one
by the log-sum-exp of the scores (``logaddexp`` of the LSEs, outputs reweighted). Causal rings
skip blocks wholly in the future, use the causal kernel on the diagonal block and the full one
on past blocks. The backward is the transpose of this program: the kernel's own backward per
block (its LSE cotangent included) and the reverse ring.

Without load balancing a causal ring leaves the last shard with ``shards`` times the first one's
work; the zig-zag layout that evens it out is not implemented.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernel_hub.kernel_api import (
    KernelInputError,
    find_mesh,
    partition_spec,
    require,
    shard_map_all,
)

from . import api

OP = "ring_attention"
_SKIP, _FULL, _DIAGONAL = 0, 1, 2


def _merge(out, lse, block_out, block_lse):
    """Two partial attentions over disjoint key sets combined into one (f32)."""
    total = jnp.logaddexp(lse, block_lse)
    safe = jnp.where(jnp.isneginf(total), 0.0, total)
    weight = jnp.where(jnp.isneginf(lse), 0.0, jnp.exp(lse - safe))[..., None]
    block_weight = jnp.where(jnp.isneginf(block_lse), 0.0, jnp.exp(block_lse - safe))[..., None]
    return out * weight + block_out.astype(jnp.float32) * block_weight, total


def _ring(q, k, v, *, axis, causal, scale, implementation):
    """The per-shard body: local query block, key/value blocks arriving around the ring."""
    shards, me = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
    batch, heads, length, _ = q.shape
    out = jnp.zeros(q.shape, jnp.float32)
    lse = jnp.full((batch, heads, length), -jnp.inf, jnp.float32)

    def attend(kind):
        def run(q, k, v):
            return api.dot_product_attention_with_lse(
                q, k, v, causal=kind == _DIAGONAL, scale=scale, implementation=implementation
            )

        def skip(q, k, v):
            return jnp.zeros(q.shape, q.dtype), jnp.full(q.shape[:3], -jnp.inf, jnp.float32)

        return skip if kind == _SKIP else run

    branches = [attend(kind) for kind in (_SKIP, _FULL, _DIAGONAL)]
    ring = [(i, (i + 1) % shards) for i in range(shards)]
    for step in range(shards):
        source = (me - step) % shards  # whose key/value block this shard holds now
        if causal:
            kind = jnp.where(source > me, _SKIP, jnp.where(source == me, _DIAGONAL, _FULL))
        else:
            kind = jnp.asarray(_FULL)
        block_out, block_lse = jax.lax.switch(kind, branches, q, k, v)
        out, lse = _merge(out, lse, block_out, block_lse)
        if step + 1 < shards:
            k, v = jax.lax.ppermute((k, v), axis, ring)
    return out.astype(q.dtype), lse


def _split_axes(q, axis: str, explicit: bool):
    """Per-dimension mesh axes: batch and heads as q has them (Explicit) or unsplit, the
    sequence over ``axis``, head_dim whole."""
    if not explicit:
        return ((), (), (axis,), ())
    spec = tuple(jax.typeof(q).sharding.spec) + (None,) * 4
    as_axes = lambda e: () if e is None else (e,) if isinstance(e, str) else tuple(e)
    return (as_axes(spec[0]), as_axes(spec[1]), (axis,), ())


def ring_attention_with_lse(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    causal: bool = False,
    scale: float | None = None,
    axis: str = "cp",
    implementation: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """``dot_product_attention_with_lse`` with the sequence split over mesh axis ``axis``.

    q [B, Hq, S, D], k/v [B, Hkv, S, D] (same S: self-attention over the whole sequence); S must
    divide by the axis size. Batch and heads may also be split (over other axes, as q has them on
    an Explicit mesh). Masks, segments, windows and soft-capping are not supported here.
    """
    api.check_inputs(query, key, value, scale=scale)
    require(
        query.shape[2] == key.shape[2],
        f"{OP}: query and key sequence lengths differ ({query.shape[2]} vs {key.shape[2]}); "
        f"ring attention is self-attention over one sequence",
    )
    found = find_mesh(OP, (query, key, value))
    if found is None:
        raise KernelInputError(
            f"{OP}: needs a mesh with a {axis!r} axis: pass arrays sharded over an Explicit-axis "
            f"mesh, or call inside kernel_hub.use_mesh(mesh)"
        )
    mesh, explicit = found
    require(axis in mesh.axis_names, f"{OP}: mesh axes {mesh.axis_names} have no {axis!r}")
    shards = mesh.shape[axis]
    require(
        query.shape[2] % shards == 0,
        f"{OP}: sequence length {query.shape[2]} must divide by the {shards} shards of {axis!r}",
    )
    q_axes = _split_axes(query, axis, explicit)
    kv_axes = (q_axes[0], q_axes[1], (axis,), ())

    def body(q, k, v):
        return _ring(q, k, v, axis=axis, causal=causal, scale=scale, implementation=implementation)

    out_specs = (partition_spec(q_axes), partition_spec(q_axes[:3]))
    return shard_map_all(
        body, mesh, (query, key, value), (q_axes, kv_axes, kv_axes), out_specs, explicit
    )


def ring_attention(query, key, value, **options) -> jax.Array:
    """The output of ``ring_attention_with_lse``."""
    return ring_attention_with_lse(query, key, value, **options)[0]
