"""The Mamba-2 scan written the way Transformers' torch fallbacks compute it (``mamba2_chunk_scan``
and ``mamba2_selective_state_update`` in models/mamba2/modeling_mamba2.py, copied into Bamba,
Nemotron-H, Falcon-H1, GraniteMoeHybrid and Zamba2), as plain jnp: the dt preparation, a
token-by-token recurrence (the oracle for the chunked forms, and float64-capable) and the decode
step.

Recurrence, per head h with state ``S [P, N]``: ``S <- exp(dt A) S + dt x B^T`` then
``y = S C + D x`` (D multiplies the raw x, not dt x). Packed rows (``seq_idx``) reset the state
to zero where the sequence index changes; the initial state applies to the row's first sequence.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

HIGHEST = jax.lax.Precision.HIGHEST


def compute_dtype(dtype) -> jnp.dtype:
    """float64 stays float64 (the oracle), everything else accumulates in float32."""
    return jnp.dtype(jnp.float64) if jnp.dtype(dtype) == jnp.float64 else jnp.dtype(jnp.float32)


def softplus(x: jax.Array) -> jax.Array:
    """torch's ``F.softplus`` (beta 1, threshold 20): linear above 20."""
    return jnp.where(x > 20, x, jnp.log1p(jnp.exp(jnp.minimum(x, 20))))


def prepare_dt(dt, dt_bias, dt_softplus: bool, dt_limit=None):
    """dt + bias, softplus, clamp, rounded in dt's dtype at each step as Transformers does
    (``dt + dt_bias.to(dt.dtype)``; softplus and clamp on that dtype), then in the compute dtype.
    The decode step never clamps (``dt_limit=None``)."""
    if dt_bias is not None:
        dt = dt + dt_bias.astype(dt.dtype)
    if dt_softplus:
        dt = softplus(dt.astype(compute_dtype(dt.dtype))).astype(dt.dtype)
    if dt_limit is not None:
        low, high = dt_limit
        dt = jnp.clip(dt, low, high)
    return dt.astype(compute_dtype(dt.dtype))


def repeat_groups(x: jax.Array, heads: int, axis: int) -> jax.Array:
    """B/C with G groups -> one per head (head h reads group ``h // (H / G)``)."""
    return jnp.repeat(x, heads // x.shape[axis], axis=axis)


def same_sequence(seq_idx: jax.Array | None, batch: int, length: int) -> jax.Array:
    """[B, L] 1.0 where token t continues the sequence of token t - 1 (token 0 continues the
    initial state), 0.0 where a packed sequence starts."""
    if seq_idx is None:
        return jnp.ones((batch, length), jnp.float32)
    previous = jnp.concatenate([seq_idx[:, :1], seq_idx[:, :-1]], axis=1)
    return (seq_idx == previous).astype(jnp.float32)


def token_scan(x, dt, A, B, C, D=None, initial_states=None, seq_idx=None):
    """Token-by-token recurrence on prepared dt ``[B, L, H]`` (after bias, softplus, clamp).

    x ``[B, L, H, P]``, A ``[H]``, B/C ``[B, L, G, N]``, D ``[H]`` or ``[H, P]``. Returns
    (y ``[B, L, H, P]``, final state ``[B, H, P, N]``), both in the compute dtype."""
    acc = compute_dtype(x.dtype)
    batch, length, heads, width = x.shape
    state_size = B.shape[-1]
    x, dt, A = x.astype(acc), dt.astype(acc), A.astype(acc)
    B, C = (repeat_groups(t.astype(acc), heads, 2) for t in (B, C))
    keep = same_sequence(seq_idx, batch, length).astype(acc)
    state = (
        jnp.zeros((batch, heads, width, state_size), acc)
        if initial_states is None
        else initial_states.astype(acc)
    )

    def step(state, inputs):
        x_t, dt_t, b_t, c_t, keep_t = inputs
        decay = jnp.exp(dt_t * A)[:, :, None, None] * keep_t[:, None, None, None]
        state = state * decay + (dt_t[:, :, None] * x_t)[..., None] * b_t[:, :, None, :]
        y = jnp.einsum("bhpn,bhn->bhp", state, c_t, precision=HIGHEST)
        return state, y

    inputs = tuple(jnp.moveaxis(t, 1, 0) for t in (x, dt, B, C, keep))
    state, y = jax.lax.scan(step, state, inputs)
    y = jnp.moveaxis(y, 0, 1)
    if D is not None:
        y = y + x * (D.astype(acc)[:, None] if D.ndim == 1 else D.astype(acc))
    return y, state


def state_update(state, x, dt, A, B, C, D=None, z=None):
    """One decode step on prepared dt ``[B, H, P]``: x ``[B, H, P]``, A ``[H, P, N]``, B/C
    ``[B, G, N]``, D ``[H, P]``, z ``[B, H, P]`` (output gate ``* silu(z)``). Returns (y in the
    compute dtype, the new state in the compute dtype); Transformers' order of products."""
    acc = compute_dtype(x.dtype)
    heads = x.shape[1]
    x, dt, A = x.astype(acc), dt.astype(acc), A.astype(acc)
    B, C = (repeat_groups(t.astype(acc), heads, 1) for t in (B, C))
    decay = jnp.exp(dt[..., None] * A)
    new_state = state.astype(acc) * decay + (dt[..., None] * B[:, :, None, :]) * x[..., None]
    y = jnp.einsum("bhpn,bhn->bhp", new_state, C, precision=HIGHEST)
    if D is not None:
        y = y + x * D.astype(acc)
    if z is not None:
        z = z.astype(acc)
        y = y * (z * jax.nn.sigmoid(z))
    return y, new_state
