"""Plain jax.numpy attention: the numerics oracle and the XLA implementation.

Scores and softmax statistics are f32 (f64 for f64 inputs); fully masked query rows give zeros and
a logsumexp of -inf (the sink's logit when there are attention sinks).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import dropout as dropout_mask
from . import masking
from .masking import AttentionSpec


def accumulation_dtype(dtype) -> jnp.dtype:
    return jnp.promote_types(dtype, jnp.float32)


def scores(q, k, spec: AttentionSpec):
    """Scaled (and soft-capped) scores [B, Hkv, G, Sq, Sk] in the accumulation dtype, for q
    grouped as [B, Hkv, G, Sq, D] and k [B, Hkv, Sk, D] (kv is not repeated)."""
    acc = accumulation_dtype(q.dtype)
    s = jnp.einsum(
        "bhgqd,bhkd->bhgqk",
        q,
        k,
        preferred_element_type=acc,
        precision=jax.lax.Precision.HIGHEST,
    ) * jnp.asarray(spec.scale, acc)
    if spec.softcap is not None:
        s = spec.softcap * jnp.tanh(s / spec.softcap)
    return s


def _grouped(x, kv_heads: int):
    """[B, H, ...] with H = Hq or 1 -> [B, Hkv, G, ...] or [B, 1, 1, ...] (broadcastable)."""
    if x.shape[1] == 1:
        return x[:, :, None]
    return x.reshape(x.shape[0], kv_heads, x.shape[1] // kv_heads, *x.shape[2:])


def attention(
    q, k, v, tokens, spec: AttentionSpec, *, sinks=None, mask=None, bias=None, dropout=None
):
    """(out [B, Hq, Sq, Dv], logsumexp [B, Hq, Sq]) for q [B, Hq, Sq, D], k [B, Hkv, Sk, D] and
    v [B, Hkv, Sk, Dv].

    ``sinks`` [Hq] is a per-head logit that joins every row's softmax denominator (attention
    sinks; it attends to a zero value). ``mask`` (boolean, True = attend) and ``bias`` (added to
    the scores) broadcast to [B, Hq, Sq, Sk] and combine with the rules of ``spec`` and the
    per-token arrays ``tokens`` (``masking.TokenMask`` or None). ``dropout`` (seed: int32 [] or
    ``dropout.words``, rate) drops the probabilities ``dropout.mask`` marks and scales the others
    by 1 / (1 - rate); the logsumexp is the undropped softmax's.
    """
    kv_heads = k.shape[1]
    q_len, kv_len = q.shape[2], k.shape[2]
    s = scores(_grouped(q, kv_heads), k, spec)
    if bias is not None:
        s = s + _grouped(bias, kv_heads).astype(s.dtype)
    allowed = _grouped(masking.dense_mask(q_len, kv_len, spec, tokens), kv_heads)
    if mask is not None:
        allowed = allowed & _grouped(mask, kv_heads)
    allowed = jnp.broadcast_to(allowed, s.shape)
    row_max = jnp.max(jnp.where(allowed, s, -jnp.inf), axis=-1, keepdims=True)
    sink = None
    if sinks is not None:
        sink = sinks.astype(s.dtype).reshape(1, kv_heads, -1, 1, 1)
        row_max = jnp.maximum(row_max, sink)
    # The row maximum only keeps exp in range; its own gradient cancels exactly.
    row_max = jax.lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    # Masked scores are replaced before exp so their (unused) gradient stays finite.
    p = jnp.where(allowed, jnp.exp(jnp.where(allowed, s, row_max) - row_max), 0.0)
    total = jnp.sum(p, axis=-1, keepdims=True)
    if sink is not None:
        total = total + jnp.exp(sink - row_max)
    safe_total = jnp.where(total > 0, total, 1.0)
    probabilities = p / safe_total
    if dropout is not None:
        seed, rate = dropout
        kept = dropout_mask.mask(seed, q.shape[0], q.shape[1], q_len, kv_len, rate)
        kept = _grouped(kept, kv_heads)
        probabilities = jnp.where(kept, probabilities * dropout_mask.scale(rate), 0.0)
    out = jnp.einsum(
        "bhgqk,bhkd->bhgqd",
        probabilities,
        v.astype(s.dtype),
        precision=jax.lax.Precision.HIGHEST,
    )
    lse = jnp.where(total > 0, row_max + jnp.log(safe_total), -jnp.inf)[..., 0]
    out_shape = (*q.shape[:3], v.shape[-1])
    return out.reshape(out_shape).astype(q.dtype), lse.reshape(q.shape[:3])
