"""Tokamax's ``dot_product_attention`` as an implementation (its Mosaic splash kernel on TPU, XLA
elsewhere). Its public API returns no logsumexp, so it serves only calls that do not ask for one.
Tokamax is optional: it is imported when this implementation first runs (the import costs
seconds), and without it this implementation says so and the next one runs.
"""

from __future__ import annotations

import importlib.util
import sys

import jax.numpy as jnp

from . import masking
from .masking import AttentionSpec


def missing() -> str | None:
    """Why this implementation cannot run here when Tokamax is not installed, else None."""
    if importlib.util.find_spec("tokamax") is None:
        return "tokamax is not installed (pip install 'kernel-hub[tokamax]')"
    return None


def _parse_tokamax_flags() -> None:
    """Tokamax reads its options from absl flags and, unless an absl app parsed them, parses
    ``sys.argv`` itself, failing on any option absl does not know (pytest's ``-x``, a script's
    own flags). Parse only the known ones first. absl is Tokamax's own dependency."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS(sys.argv, known_only=True)


def attention(q, k, v, q_segment_ids, kv_segment_ids, spec: AttentionSpec):
    """Output [B, Hq, Sq, D]; same arguments and mask rules as ``reference.attention``."""
    q_len, kv_len = q.shape[2], k.shape[2]
    positional = spec.causal or spec.sliding_window is not None
    # Tokamax aligns queries to the start of the keys; equal lengths make that our end alignment.
    # Without segments every query then sees at least itself.
    if q_segment_ids is None and (q_len == kv_len or not positional):
        mask, causal = None, spec.causal
        window = None
        if spec.sliding_window is not None:
            reach = spec.sliding_window - 1
            window = (reach, 0) if spec.causal else (reach, reach)
    else:
        mask = masking.dense_mask(
            q_len, kv_len, spec, masking.TokenMask(q_segment_ids, kv_segment_ids)
        )
        causal, window = False, None
    import tokamax

    _parse_tokamax_flags()
    out = tokamax.dot_product_attention(
        q.swapaxes(1, 2),
        k.swapaxes(1, 2),
        v.swapaxes(1, 2),
        mask=mask,
        scale=spec.scale,
        is_causal=causal,
        local_window_size=window,
        logits_soft_cap=spec.softcap,
    ).swapaxes(1, 2)
    if mask is None:
        return out
    # Tokamax averages all values for a query that sees no key; our rule is zeros.
    return jnp.where(jnp.any(mask, axis=-1, keepdims=True), out, 0).astype(out.dtype)
