"""The token statistics in plain XLA without the full logits: a scan over vocabulary chunks with
an online log-sum-exp, each step rematerialised in the backward (``jax.checkpoint``), so the
temporaries are O(tokens x chunk) on any platform (the CPU and GPU path of the kernel).

The weight is never padded: the last chunk starts at ``vocab - chunk`` and masks the columns an
earlier chunk already counted.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .reference import LogitForm, accumulation_dtype, transform

CHUNK = 4096


def token_statistics(hidden, weight, bias, targets, form: LogitForm, chunk: int = CHUNK):
    """``reference.token_statistics`` over vocabulary chunks of ``chunk`` rows."""
    tokens = hidden.shape[0]
    vocab = weight.shape[0]
    chunk = min(chunk, vocab)
    steps = -(-vocab // chunk)
    acc = accumulation_dtype(hidden.dtype)
    precision = jax.lax.Precision.HIGHEST if hidden.dtype == acc else None

    @jax.checkpoint
    def step(carry, index):
        m, norm, target, total = carry
        start = jnp.minimum(index * chunk, vocab - chunk)
        w = jax.lax.dynamic_slice_in_dim(weight, start, chunk, 0)
        logits = jnp.dot(hidden, w.T, preferred_element_type=acc, precision=precision)
        if bias is not None:
            logits = logits + jax.lax.dynamic_slice_in_dim(bias, start, chunk, 0).astype(acc)
        z = transform(logits, form)
        columns = start + jnp.arange(chunk)
        fresh = (columns >= index * chunk)[None, :]
        z_in = jnp.where(fresh, z, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(z_in, axis=1))
        norm = norm * jnp.exp(m - m_new) + jnp.sum(jnp.exp(z_in - m_new[:, None]), axis=1)
        hit = fresh & (columns[None, :] == targets[:, None])
        target = target + jnp.sum(jnp.where(hit, z, 0.0), axis=1)
        total = total + jnp.sum(jnp.where(fresh, z, 0.0), axis=1)
        return (m_new, norm, target, total), None

    zeros = jnp.zeros((tokens,), acc)
    init = (jnp.full((tokens,), -jnp.inf, acc), zeros, zeros, zeros)
    (m, norm, target, total), _ = jax.lax.scan(step, init, jnp.arange(steps))
    return m + jnp.log(norm), target, total
