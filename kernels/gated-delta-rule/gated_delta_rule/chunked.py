"""The chunked gated delta rule in XLA (the ``xla`` implementation; its backward is ``jax.vjp``
of this function, the Pallas implementation has its own backward kernel).

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


def _decays(g):
    """Cumulative log decay [..., C] and the masked pairwise decay [..., C, C] of a chunk."""
    chunk = g.shape[-1]
    cum = jnp.cumsum(g, axis=-1)
    lower = jnp.tril(jnp.ones((chunk, chunk), bool))
    return cum, jnp.exp(jnp.where(lower, cum[..., :, None] - cum[..., None, :], -jnp.inf))


def chunk_solve(k, v, g, beta):
    """The UT transform's solve per chunk: [new values | k cumdecay], [..., C, V + K]."""
    cum, decay = _decays(g)
    k_beta = k * beta[..., None]
    strict = jnp.tril(_mm(k_beta, jnp.swapaxes(k, -1, -2)) * decay, -1)
    rhs = jnp.concatenate([v * beta[..., None], k_beta * jnp.exp(cum)[..., None]], axis=-1)
    return unit_lower_solve(strict, rhs)


def chunked(q, k, v, g, beta, initial_state, p: Plan, chunk: int):
    """q, k [B, H, L, K], v [B, H, L, V], g, beta [B, H, L], initial_state [N, H, K, V] ->
    (o [B, H, L, V], final states [N, H, K, V]).

    The solves run batched over all chunks (their substitution is sequential in the chunk's rows);
    the rest of each chunk's work is computed inside its scan step, which the backward recomputes
    (``jax.checkpoint``): it keeps only the solves and each step's input state, not every
    per-chunk [C, C] and [C, K] term (an 8k-token Qwen3-Next layer's backward: 2.3 GiB of
    temporaries on v5e instead of 3.3 GiB, deviceless compile). Moving the solves into the steps
    too gives 1.5 GiB but runs 64 dependent substitution rows per chunk one chunk at a time."""
    batch, heads, length = g.shape
    values = v.shape[-1]

    def chunks(x):
        return jnp.moveaxis(x.reshape(batch, heads, length // chunk, chunk, *x.shape[3:]), 2, 0)

    q, k, v, g, beta = (chunks(x) for x in (q, k, v, g, beta))
    solved = chunk_solve(k, v, g, beta)
    rows = jnp.arange(batch)

    @jax.checkpoint
    def step(carry, xs):
        state, finals = carry
        q, k, g, solved, sequence, starts = xs
        cum, decay = _decays(g)
        new_values, k_cumdecay = solved[..., :values], solved[..., values:]
        state = jnp.where(starts[:, None, None, None] > 0, initial_state[sequence], state)
        v_new = new_values - _mm(k_cumdecay, state)
        attn = _mm(q, jnp.swapaxes(k, -1, -2)) * decay
        out = _mm(q * jnp.exp(cum)[..., None], state) + _mm(attn, v_new)
        k_decayed = k * jnp.exp(cum[..., -1:] - cum)[..., None]
        state = state * jnp.exp(cum[..., -1])[..., None, None]
        state = state + _mm(jnp.swapaxes(k_decayed, -1, -2), v_new)
        return (state, finals.at[sequence].set(state)), out

    xs = (q, k, g, solved, p.chunk_sequence.T, p.chunk_starts.T)
    state = initial_state[p.chunk_sequence[rows, 0]]
    (_, finals), out = jax.lax.scan(step, (state, initial_state), xs)
    out = jnp.moveaxis(out, 0, 2).reshape(batch, heads, length, values)
    return out, finals
