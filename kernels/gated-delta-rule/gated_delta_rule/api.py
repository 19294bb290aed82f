"""Public JAX API: ``chunk_gated_delta_rule`` (prefill, training; packed sequences) and
``recurrent_gated_delta_rule`` (decode), each with an implementation table (pallas, xla) and input
checks. Shapes and numerics are Transformers' (see ``reference``)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernel_hub.kernel_api import (
    FLOATS_AND_F64,
    Einsum,
    check_dtype,
    check_offset_values,
    check_rank,
    float64_problem,
    jax_platform,
    op,
    pallas_and_xla,
    require,
    tiling,
)

from . import chunked, layout, pallas_tpu, reference

CHUNK_OP = "chunk_gated_delta_rule"
DECODE_OP = "recurrent_gated_delta_rule"
INTEGERS = ("int32", "int64")


def check_offsets(op, q, cu_seqlens=None) -> None:
    """On every call where they can be read: ``cu_seqlens`` covering q's packed tokens."""
    if cu_seqlens is not None:
        check_offset_values(op, "cu_seqlens", cu_seqlens, q.shape[1])


def check_inputs(op, q, k, v, g, beta, initial_state=None, cu_seqlens=None) -> None:
    """Shape and dtype rules shared by the JAX functions and the torch ops."""
    for name, x, rank in (("q", q, 4), ("k", k, 4), ("v", v, 4), ("g", g, 3), ("beta", beta, 3)):
        check_rank(op, name, x, rank)
        check_dtype(op, name, x, FLOATS_AND_F64)
    batch, length, key_heads, key_dim = q.shape
    heads = v.shape[2]
    require(
        tuple(k.shape) == tuple(q.shape),
        f"{op}: k has shape {tuple(k.shape)} but q has {tuple(q.shape)}; they must match",
    )
    require(
        tuple(v.shape[:2]) == (batch, length) and heads % key_heads == 0,
        f"{op}: v has shape {tuple(v.shape)}; it must be [{batch}, {length}, HV, V] with HV a "
        f"multiple of q/k's {key_heads} heads",
    )
    for name, x in (("g", g), ("beta", beta)):
        require(
            tuple(x.shape) == (batch, length, heads),
            f"{op}: {name} has shape {tuple(x.shape)}; it must be [B, T, HV] = "
            f"{[batch, length, heads]}",
        )
    sequences = batch
    if cu_seqlens is not None:
        check_rank(op, "cu_seqlens", cu_seqlens, 1)
        check_dtype(op, "cu_seqlens", cu_seqlens, INTEGERS)
        require(
            batch == 1 and cu_seqlens.shape[0] >= 2,
            f"{op}: cu_seqlens packs sequences into a batch of one; got batch {batch} and "
            f"{cu_seqlens.shape[0]} offsets (need >= 2)",
        )
        sequences = cu_seqlens.shape[0] - 1
    if initial_state is not None:
        check_dtype(op, "initial_state", initial_state, FLOATS_AND_F64)
        wanted = (sequences, heads, key_dim, v.shape[3])
        require(
            tuple(initial_state.shape) == wanted,
            f"{op}: initial_state has shape {tuple(initial_state.shape)}; it must be "
            f"[sequences, HV, K, V] = {list(wanted)}",
        )


def _prepared(q, k, v, g, beta, initial_state, sequences, use_qk_l2norm, scale):
    acc = reference.compute_dtype(q.dtype)
    q, k = reference.prepare_qk(q, k, use_qk_l2norm, scale)
    shape = (sequences, v.shape[2], q.shape[-1], v.shape[-1])
    state = jnp.zeros(shape, acc) if initial_state is None else initial_state.astype(acc)
    return q, k, v, g.astype(acc), beta.astype(acc), state


def _chunk_pallas(q, k, v, g, beta, initial_state, cu_seqlens, *, chunk_size, use_qk_l2norm, scale):
    out_dtype = q.dtype
    batch, length = q.shape[:2]
    sequences = batch if cu_seqlens is None else cu_seqlens.shape[0] - 1
    q, k, v, g, beta, state = _prepared(
        q, k, v, g, beta, initial_state, sequences, use_qk_l2norm, scale
    )
    p = layout.plan(batch, length, chunk_size, cu_seqlens)
    q, k, v, g, beta = (layout.to_chunks(x, p) for x in (q, k, v, g, beta))
    out, final = pallas_tpu.chunk_gated_delta_rule(
        q,
        k,
        v,
        g,
        beta,
        state,
        p.chunk_sequence,
        p.chunk_starts,
        pallas_tpu.ChunkConfig(chunk_size),
        out_dtype,
        jax_platform() == "cpu",
    )
    return layout.from_chunks(out, p, length), final


def _chunk_xla(q, k, v, g, beta, initial_state, cu_seqlens, *, chunk_size, use_qk_l2norm, scale):
    out_dtype = q.dtype
    batch, length, heads = v.shape[:3]
    sequences = batch if cu_seqlens is None else cu_seqlens.shape[0] - 1
    q, k, v, g, beta, state = _prepared(
        q, k, v, g, beta, initial_state, sequences, use_qk_l2norm, scale
    )
    q, k = reference.repeat_heads(q, heads), reference.repeat_heads(k, heads)
    p = layout.plan(batch, length, chunk_size, cu_seqlens)
    q, k, v, g, beta = (layout.to_chunks(x, p) for x in (q, k, v.astype(state.dtype), g, beta))
    out, final = chunked.chunked(q, k, v, g, beta, state, p, chunk_size)
    return layout.from_chunks(out, p, length).astype(out_dtype), final


def _chunk_pallas_problem(q, *args, chunk_size, **kwargs):
    return float64_problem(q) or tiling.chunk_problem(chunk_size)


CHUNK_TABLE = pallas_and_xla(CHUNK_OP, _chunk_pallas, _chunk_xla, _chunk_pallas_problem)

# Sharding: batch and heads split (value heads together with their q/k heads, so each shard keeps
# whole groups); the sequence, head dims and packing offsets stay whole (the state recurrence
# runs along the sequence). Gradients flow to q, k, v, g, beta and the initial state.
_QK = "batch length key_heads key_dim"
_V = "batch length heads value_dim"
_G = "batch length heads"
_STATE = "sequences heads key_dim value_dim"
_SHARDING = {
    "whole": ("length", "key_dim", "value_dim"),
    "together": (("heads", "key_heads"), ("batch", "sequences")),
    "handled_by": {"length": "nothing yet: the recurrence needs the whole sequence per shard"},
}
_DIFFERENTIABLE = ("q", "k", "v", "g", "beta", "initial_state")


@op(
    check=functools.partial(check_inputs, CHUNK_OP),
    check_values=functools.partial(check_offsets, CHUNK_OP),
    differentiable=_DIFFERENTIABLE,
    sharding=Einsum(
        f"{_QK}, {_QK}, {_V}, {_G}, {_G}, {_STATE}, offsets -> {_V}, {_STATE}",
        **{**_SHARDING, "whole": (*_SHARDING["whole"], "offsets")},
    ),
)
def chunk_gated_delta_rule(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    initial_state: jax.Array | None = None,
    cu_seqlens: jax.Array | None = None,
    *,
    chunk_size: int = 64,
    use_qk_l2norm: bool = False,
    scale: float | None = None,
    implementation: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Gated delta rule over whole sequences, chunk by chunk.

    q, k ``[B, T, HK, K]``, v ``[B, T, HV, V]``, g (log decay, <= 0) and beta ``[B, T, HV]``,
    initial_state ``[N, HV, K, V]`` (zeros when None); ``cu_seqlens`` ``[N + 1]`` packs N
    sequences into a batch of one (each starts from its own initial state), otherwise N = B.
    Returns (o ``[B, T, HV, V]`` in q's dtype, final states ``[N, HV, K, V]`` in f32, f64 for f64
    inputs). ``use_qk_l2norm`` L2-normalises q and k first; q is scaled by ``scale`` (default
    ``K ** -0.5``). ``chunk_size`` only changes rounding.
    """
    require(
        isinstance(chunk_size, int) and chunk_size > 0,
        f"{CHUNK_OP}: chunk_size={chunk_size!r}; it must be a positive int (64 by default)",
    )
    return CHUNK_TABLE(
        q,
        k,
        v,
        g,
        beta,
        initial_state,
        cu_seqlens,
        chunk_size=chunk_size,
        use_qk_l2norm=use_qk_l2norm,
        scale=scale,
        implementation=implementation,
    )


def _decode_pallas(q, k, v, g, beta, initial_state, *, use_qk_l2norm, scale):
    out_dtype = q.dtype
    q, k, v, g, beta, state = _prepared(
        q, k, v, g, beta, initial_state, q.shape[0], use_qk_l2norm, scale
    )
    q_t, k_t = (jnp.transpose(x, (0, 2, 3, 1)) for x in (q, k))
    v, g, beta = jnp.moveaxis(v, 1, 2), jnp.moveaxis(g, 1, 2), jnp.moveaxis(beta, 1, 2)
    out, state = pallas_tpu.recurrent_gated_delta_rule(
        q_t, k_t, v, g, beta, state, out_dtype, jax_platform() == "cpu"
    )
    return jnp.moveaxis(out, 2, 1), state


def _decode_xla(q, k, v, g, beta, initial_state, *, use_qk_l2norm, scale):
    out, state = reference.gated_delta_rule(
        q, k, v, g, beta, initial_state, use_qk_l2norm=use_qk_l2norm, scale=scale
    )
    return out.astype(q.dtype), state


def _decode_pallas_problem(q, *args, **kwargs):
    tokens, most = q.shape[1], pallas_tpu.MAX_DECODE_TOKENS
    return float64_problem(q) or (
        f"{tokens} tokens per sequence; the decode kernel unrolls at most {most} (use "
        "chunk_gated_delta_rule for prefill)"
        if tokens > most
        else None
    )


DECODE_TABLE = pallas_and_xla(DECODE_OP, _decode_pallas, _decode_xla, _decode_pallas_problem)


@op(
    check=functools.partial(check_inputs, DECODE_OP),
    check_values=functools.partial(check_offsets, DECODE_OP),
    differentiable=_DIFFERENTIABLE,
    sharding=Einsum(f"{_QK}, {_QK}, {_V}, {_G}, {_G}, {_STATE} -> {_V}, {_STATE}", **_SHARDING),
)
def recurrent_gated_delta_rule(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    initial_state: jax.Array | None = None,
    *,
    use_qk_l2norm: bool = False,
    scale: float | None = None,
    implementation: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Gated delta rule token by token (decode: one or a few tokens per sequence).

    Same shapes and options as ``chunk_gated_delta_rule`` without packing: initial_state
    ``[B, HV, K, V]``. Returns (o ``[B, T, HV, V]`` in q's dtype, the new state in f32). The Pallas
    kernel aliases the new state to ``initial_state`` (in place when the caller donates it).
    """
    return DECODE_TABLE(
        q,
        k,
        v,
        g,
        beta,
        initial_state,
        use_qk_l2norm=use_qk_l2norm,
        scale=scale,
        implementation=implementation,
    )
