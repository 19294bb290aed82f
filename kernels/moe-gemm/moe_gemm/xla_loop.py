"""Grouped matmuls as XLA loops over experts and row chunks: the fast path on CPU.

XLA's CPU ``ragged_dot`` multiplies every row by every expert's weights (E times the work), and
any static-shape formulation reads all E weight matrices. Here a loop visits each expert once,
reads its weights only when it has rows, and multiplies its rows in chunks of ``chunk_rows``
(dynamic trip counts, so empty experts cost nothing). Chunks of other experts' rows inside a
chunk are masked, so the work is at most ``m + E * chunk_rows`` rows. On TPU, loops like these
serialize what the MXU should batch: use pallas there. Not differentiable by JAX (dynamic
loops); ``vjp.py`` differentiates it with itself.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .reference import accumulator_dtype
from .schedule import cdiv, group_bounds

ZERO = np.int32(0)
MIN_CHUNK_ROWS = 8
MAX_CHUNK_ROWS = 128


def chunk_rows(rows: int, groups: int) -> int:
    """About one chunk per expert's share of the rows, within [8, 128] (and at most ``rows``)."""
    share = cdiv(cdiv(rows, groups), MIN_CHUNK_ROWS) * MIN_CHUNK_ROWS
    return max(1, min(rows, MAX_CHUNK_ROWS, max(MIN_CHUNK_ROWS, share)))


def _over_chunks(start, end, chunk: int, step, carry):
    """``step(row, valid_rows, carry)`` for each ``chunk``-row piece of rows [start, end)."""

    def body(i, carry):
        # int32 throughout: under x64 a mix of int32/int64 indices is a dynamic_slice error.
        row = (start + i * chunk).astype(jnp.int32)
        return step(row, jnp.minimum(end - row, chunk), carry)

    return jax.lax.fori_loop(0, cdiv(end - start, chunk), body, carry)


def gmm(lhs, rhs, group_sizes, *, transpose_rhs: bool, out_dtype, tiling=None):
    """``out[rows of g] = lhs[rows of g] @ rhs[g]`` (``rhs[g].T`` if ``transpose_rhs``)."""
    del tiling  # Pallas only
    m, k = lhs.shape
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    chunk = chunk_rows(m, rhs.shape[0])
    acc = accumulator_dtype(lhs.dtype)
    padded = jnp.pad(lhs, ((0, chunk), (0, 0)))  # a chunk starting on any row stays in bounds
    contract = 1 if transpose_rhs else 0
    bounds = group_bounds(group_sizes, m)

    def expert(e, out):
        start, end = bounds.starts[e], bounds.ends[e]
        # Only experts with rows read their weights.
        return jax.lax.cond(end > start, expert_rows, lambda *args: args[-1], e, start, end, out)

    def expert_rows(e, start, end, out):
        weights = rhs[e]

        def step(row, valid, out):
            x = jax.lax.dynamic_slice(padded, (row, ZERO), (chunk, k))
            y = jax.lax.dot_general(
                x,
                weights,
                (((1,), (contract,)), ((), ())),
                precision=jax.lax.Precision.HIGHEST,
                preferred_element_type=acc,
            )
            old = jax.lax.dynamic_slice(out, (row, ZERO), (chunk, n))
            keep = jnp.arange(chunk)[:, None] < valid
            return jax.lax.dynamic_update_slice(out, jnp.where(keep, y, old), (row, ZERO))

        return _over_chunks(start, end, chunk, step, out)

    out = jax.lax.fori_loop(0, rhs.shape[0], expert, jnp.zeros((m + chunk, n), acc))
    return out[:m].astype(out_dtype)


def tgmm(lhs, grad, group_sizes, *, out_dtype, tiling=None):
    """``out[g] = lhs[rows of g].T @ grad[rows of g]``; groups without rows give zeros."""
    del tiling  # Pallas only
    (m, k), n = lhs.shape, grad.shape[1]
    groups = group_sizes.shape[0]
    chunk = chunk_rows(m, groups)
    acc = accumulator_dtype(lhs.dtype)
    lhs_padded = jnp.pad(lhs, ((0, chunk), (0, 0)))
    grad_padded = jnp.pad(grad, ((0, chunk), (0, 0)))
    bounds = group_bounds(group_sizes, m)

    def step(row, valid, total):
        keep = jnp.arange(chunk)[:, None] < valid
        x = jnp.where(keep, jax.lax.dynamic_slice(lhs_padded, (row, ZERO), (chunk, k)), 0)
        g = jnp.where(keep, jax.lax.dynamic_slice(grad_padded, (row, ZERO), (chunk, n)), 0)
        return total + jax.lax.dot_general(
            x,
            g,
            (((0,), (0,)), ((), ())),
            precision=jax.lax.Precision.HIGHEST,
            preferred_element_type=acc,
        )

    def expert(e, out):
        total = _over_chunks(bounds.starts[e], bounds.ends[e], chunk, step, jnp.zeros((k, n), acc))
        return out.at[e].set(total)

    out = jax.lax.fori_loop(0, groups, expert, jnp.zeros((groups, k, n), acc))
    return out.astype(out_dtype)
