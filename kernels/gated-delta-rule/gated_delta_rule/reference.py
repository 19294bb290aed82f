"""Plain jnp gated delta rule: the token-by-token recurrence (the float64 oracle and the XLA
decode path) and the input preparation every implementation shares.

Numerics follow Transformers' torch fallbacks (qwen3_next ``torch_recurrent_gated_delta_rule``):
everything in f32 (f64 for f64 inputs); the optional L2 norm is ``x * rsqrt(sum x^2 + 1e-6)``;
the query is then scaled (``K ** -0.5`` by default); per token the state is decayed first, the
prediction read from the decayed state, the output read from the updated state:

    S <- exp(g) S;   u = S^T k;   S <- S + k (beta (v - u))^T;   o = S^T q

With more value heads than q/k heads, value head ``h`` reads q/k head ``h // (HV // HK)``.
Layouts are Transformers': q, k ``[B, T, HK, K]``, v ``[B, T, HV, V]``, g, beta ``[B, T, HV]``,
state ``[B, HV, K, V]``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

L2_EPS = 1e-6


def compute_dtype(dtype) -> jnp.dtype:
    """f64 stays f64 (the oracle); everything else computes in f32."""
    return jnp.dtype(jnp.float64) if jnp.dtype(dtype) == jnp.float64 else jnp.dtype(jnp.float32)


def l2norm(x: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_EPS)


def prepare_qk(q, k, use_qk_l2norm: bool, scale: float | None):
    """q, k in the compute dtype, L2-normalised if asked, q scaled."""
    acc = compute_dtype(q.dtype)
    q, k = q.astype(acc), k.astype(acc)
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    return q * (q.shape[-1] ** -0.5 if scale is None else scale), k


def repeat_heads(x, num_v_heads: int):
    """q/k heads repeated to the value heads: value head h reads q/k head h // (HV // HK)."""
    groups = num_v_heads // x.shape[2]
    return jnp.repeat(x, groups, axis=2) if groups > 1 else x


def recurrence(q, k, v, g, beta, state):
    """One sequence batch, prepared inputs: q, k [B, T, H, K], v [B, T, H, V], g, beta [B, T, H],
    state [B, H, K, V]; returns (o [B, T, H, V], final state)."""

    def step(s, xs):
        q_t, k_t, v_t, g_t, b_t = xs
        s = s * jnp.exp(g_t)[..., None, None]
        predicted = jnp.sum(s * k_t[..., :, None], axis=-2)
        delta = (v_t - predicted) * b_t[..., None]
        s = s + k_t[..., :, None] * delta[..., None, :]
        return s, jnp.sum(s * q_t[..., :, None], axis=-2)

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta))
    state, out = jax.lax.scan(step, state, xs)
    return jnp.moveaxis(out, 0, 1), state


def gated_delta_rule(
    q,
    k,
    v,
    g,
    beta,
    initial_state=None,
    cu_seqlens=None,
    *,
    use_qk_l2norm: bool = False,
    scale: float | None = None,
):
    """(o [B, T, HV, V], final state [N, HV, K, V] in the compute dtype), token by
    token. With ``cu_seqlens`` ([N + 1] offsets into a packed batch of one, B == 1) each sequence
    starts from its own ``initial_state[n]`` (zeros when None) and gets its own final state."""
    acc = compute_dtype(q.dtype)
    batch, length, heads = v.shape[:3]
    q, k = (repeat_heads(x, heads) for x in prepare_qk(q, k, use_qk_l2norm, scale))
    v, g, beta = v.astype(acc), g.astype(acc), beta.astype(acc)
    sequences = batch if cu_seqlens is None else cu_seqlens.shape[0] - 1
    state = (
        jnp.zeros((sequences, heads, q.shape[-1], v.shape[-1]), acc)
        if initial_state is None
        else initial_state.astype(acc)
    )
    if cu_seqlens is None:
        return recurrence(q, k, v, g, beta, state)
    # Packed: reset the state at every sequence start, record it at every sequence end.
    position = jnp.arange(length)
    sequence = jnp.searchsorted(cu_seqlens[1:], position, side="right")
    starts = position == cu_seqlens[sequence]

    def step(carry, xs):
        s, finals = carry
        q_t, k_t, v_t, g_t, b_t, n, first = xs
        s = jnp.where(first, state[n], s)
        s = s * jnp.exp(g_t)[:, None, None]
        predicted = jnp.sum(s * k_t[:, :, None], axis=-2)
        delta = (v_t - predicted) * b_t[:, None]
        s = s + k_t[:, :, None] * delta[:, None, :]
        finals = finals.at[n].set(s)
        return (s, finals), jnp.sum(s * q_t[:, :, None], axis=-2)

    xs = (q[0], k[0], v[0], g[0], beta[0], sequence, starts)
    (_, finals), out = jax.lax.scan(step, (state[0], state), xs)
    return out[None], finals
