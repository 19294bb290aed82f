"""The chunked gated delta rule in XLA (the ``xla`` implementation, and the backward of every
chunked implementation: ``jax.vjp`` of this function).

Within a chunk of C tokens the delta-rule updates are condensed by a unit-lower-triangular solve
(the UT transform, as in Transformers' ``torch_chunk_gated_delta_rule``); across chunks a scan
carries the [K, V] state. The solve is forward substitution in plain XLA ops (as the Pallas kernel
does it), with its own VJP: ``jax.scipy.linalg.solve_triangular`` lowers on CPU to a LAPACK
custom call whose batch loop waits on XLA's intra-op thread pool from inside that pool, and two
such calls running at once (the forward's and the transposed solve of the backward) deadlock a
two-thread pool (a model's backward hung forever on a two-core machine). Inputs are in the
chunk-aligned layout (``layout``), prepared (q/k normalised, scaled, repeated to the value heads)
and in the compute dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .layout import Plan

HIGHEST = jax.lax.Precision.HIGHEST


def _mm(a, b):
    return jnp.matmul(a, b, precision=HIGHEST)


def _substitute(strict, rhs, transpose: bool):
    """Solve ``(I + L) x = rhs`` (``(I + L)^T x = rhs`` if ``transpose``) row by row; ``strict``
    is L, strictly lower ([..., C, C]), rhs [..., C, W]. Row i of x takes ``rhs_i - L_i x`` (or
    ``- L[:, i]^T x``): the rows not yet solved meet zero coefficients."""
    chunk = rhs.shape[-2]

    def step(i, x):
        row = chunk - 1 - i if transpose else i
        if transpose:
            coeff = jnp.swapaxes(jax.lax.dynamic_slice_in_dim(strict, row, 1, axis=-1), -1, -2)
        else:
            coeff = jax.lax.dynamic_slice_in_dim(strict, row, 1, axis=-2)
        solved = jax.lax.dynamic_slice_in_dim(x, row, 1, axis=-2) - _mm(coeff, x)
        return jax.lax.dynamic_update_slice_in_dim(x, solved, row, axis=-2)

    return jax.lax.fori_loop(0, chunk, step, rhs)


@jax.custom_vjp
def unit_lower_solve(strict, rhs):
    """x with ``(I + L) x = rhs``, L = ``strict`` (strictly lower, [..., C, C]), rhs [..., C, W]."""
    return _substitute(strict, rhs, transpose=False)


def _solve_fwd(strict, rhs):
    x = unit_lower_solve(strict, rhs)
    return x, (strict, x)


def _solve_bwd(residuals, d_x):
    # x = A^-1 rhs with A = I + L: d_rhs = A^-T d_x, d_L = -d_rhs x^T on the strictly lower part.
    strict, x = residuals
    d_rhs = _substitute(strict, d_x, transpose=True)
    return jnp.tril(-_mm(d_rhs, jnp.swapaxes(x, -1, -2)), -1), d_rhs


unit_lower_solve.defvjp(_solve_fwd, _solve_bwd)


def intra_chunk(q, k, v, g, beta):
    """Per-chunk quantities ([..., C, *]): the state-independent parts of the chunk step."""
    chunk = q.shape[-2]
    cum = jnp.cumsum(g, axis=-1)
    lower = jnp.tril(jnp.ones((chunk, chunk), bool))
    decay = jnp.exp(jnp.where(lower, cum[..., :, None] - cum[..., None, :], -jnp.inf))
    k_t = jnp.swapaxes(k, -1, -2)
    k_beta = k * beta[..., None]
    strict = jnp.tril(_mm(k_beta, k_t) * decay, -1)
    rhs = jnp.concatenate([v * beta[..., None], k_beta * jnp.exp(cum)[..., None]], axis=-1)
    solved = unit_lower_solve(strict, rhs)
    new_values, k_cumdecay = solved[..., : v.shape[-1]], solved[..., v.shape[-1] :]
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
