"""The chunked gated delta rule in XLA (the ``xla`` implementation, and the backward of every
chunked implementation: ``jax.vjp`` of this function).

Within a chunk of C tokens the delta-rule updates are condensed by a unit-lower-triangular solve
(the UT transform, as in Transformers' ``torch_chunk_gated_delta_rule``); across chunks a scan
carries the [K, V] state. Inputs are in the chunk-aligned layout (``layout``), prepared (q/k
normalised, scaled, repeated to the value heads) and in the compute dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.scipy.linalg import solve_triangular

from .layout import Plan

HIGHEST = jax.lax.Precision.HIGHEST


def _mm(a, b):
    return jnp.matmul(a, b, precision=HIGHEST)


def intra_chunk(q, k, v, g, beta):
    """Per-chunk quantities ([..., C, *]): the state-independent parts of the chunk step."""
    chunk = q.shape[-2]
    cum = jnp.cumsum(g, axis=-1)
    lower = jnp.tril(jnp.ones((chunk, chunk), bool))
    decay = jnp.exp(jnp.where(lower, cum[..., :, None] - cum[..., None, :], -jnp.inf))
    k_t = jnp.swapaxes(k, -1, -2)
    k_beta = k * beta[..., None]
    system = _mm(k_beta, k_t) * decay
    new_values = solve_triangular(system, v * beta[..., None], lower=True, unit_diagonal=True)
    k_cumdecay = solve_triangular(
        system, k_beta * jnp.exp(cum)[..., None], lower=True, unit_diagonal=True
    )
    attn = _mm(q, k_t) * decay
    q_decayed = q * jnp.exp(cum)[..., None]
    k_decayed = k * jnp.exp(cum[..., -1:] - cum)[..., None]
    chunk_decay = jnp.exp(cum[..., -1])[..., None, None]
    return new_values, k_cumdecay, attn, q_decayed, k_decayed, chunk_decay


def chunked(q, k, v, g, beta, initial_state, p: Plan, chunk: int):
    """q, k [B, H, L, K], v [B, H, L, V], g, beta [B, H, L], initial_state [N, H, K, V] ->
    (o [B, H, L, V], final states [N, H, K, V])."""
    batch, heads, length = g.shape

    def chunks(x):
        return jnp.moveaxis(x.reshape(batch, heads, length // chunk, chunk, *x.shape[3:]), 2, 0)

    parts = intra_chunk(*(chunks(x) for x in (q, k, v, g, beta)))
    rows = jnp.arange(batch)

    def step(carry, xs):
        state, finals = carry
        new_values, k_cumdecay, attn, q_decayed, k_decayed, chunk_decay, sequence, starts = xs
        state = jnp.where(starts[:, None, None, None] > 0, initial_state[sequence], state)
        v_new = new_values - _mm(k_cumdecay, state)
        out = _mm(q_decayed, state) + _mm(attn, v_new)
        state = state * chunk_decay + _mm(jnp.swapaxes(k_decayed, -1, -2), v_new)
        return (state, finals.at[sequence].set(state)), out

    xs = (*parts, p.chunk_sequence.T, p.chunk_starts.T)
    state = initial_state[p.chunk_sequence[rows, 0]]
    (_, finals), out = jax.lax.scan(step, (state, initial_state), xs)
    out = jnp.moveaxis(out, 0, 2).reshape(batch, heads, length, v.shape[-1])
    return out, finals
