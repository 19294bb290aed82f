"""Plain jax.numpy fused-linear cross-entropy: the numerics oracle and the XLA implementation.

The loss is split in two so every implementation shares the second half:

* ``token_statistics``: per token, over the transformed logits ``z`` (see ``LogitForm``), the
  log-sum-exp, the target's logit and the sum of all logits. This is the part that touches the
  ``[tokens, vocab]`` logits; the Pallas kernel computes it blockwise without materialising them.
* ``loss_from_statistics``: ignore_index, label smoothing, z-loss and the reduction, O(tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

REDUCTIONS = ("mean", "sum", "none")
NO_TARGET = -1
"""Target id of an ignored token inside the statistics (matches no vocabulary column)."""


@dataclass(frozen=True)
class LogitForm:
    """``z = softcap * tanh(scale * logits / softcap)`` (no tanh without ``softcap``).

    ``scale`` is Cohere's ``logit_scale`` (Granite's ``1 / logits_scaling``); ``softcap`` is
    Gemma 2/3's ``final_logit_softcapping``."""

    scale: float = 1.0
    softcap: float | None = None


def accumulation_dtype(dtype) -> jnp.dtype:
    """Logits and statistics in f32 (f64 for f64 inputs)."""
    return jnp.promote_types(dtype, jnp.float32)


def transform(logits: jax.Array, form: LogitForm) -> jax.Array:
    """The logit form applied to raw logits in the accumulation dtype (shared with the kernel)."""
    if form.scale != 1.0:
        logits = logits * form.scale
    if form.softcap is not None:
        logits = jnp.tanh(logits / form.softcap) * form.softcap
    return logits


def token_statistics(hidden, weight, bias, targets, form: LogitForm):
    """(lse, target logit, sum of logits), each [tokens] in the accumulation dtype.

    ``targets`` are vocabulary ids; ``NO_TARGET`` (or any id outside the vocabulary) picks
    nothing and gives a target logit of 0. Materialises the logits: the XLA path."""
    acc = accumulation_dtype(hidden.dtype)
    precision = jax.lax.Precision.HIGHEST if acc == jnp.float64 or hidden.dtype == acc else None
    logits = jnp.dot(hidden, weight.T, preferred_element_type=acc, precision=precision)
    if bias is not None:
        logits = logits + bias.astype(acc)
    z = transform(logits, form)
    lse = jax.nn.logsumexp(z, axis=-1)
    picked = jnp.take_along_axis(z, jnp.clip(targets, 0, z.shape[-1] - 1)[:, None], axis=-1)[:, 0]
    inside = (targets >= 0) & (targets < z.shape[-1])
    return lse, jnp.where(inside, picked, 0.0), jnp.sum(z, axis=-1)


def loss_from_statistics(
    lse,
    target,
    total,
    labels,
    vocab: int,
    *,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    z_loss: float,
    token_axes: tuple[str, ...] = (),
):
    """torch's ``cross_entropy(z, labels, ignore_index, reduction, label_smoothing)`` from the
    statistics, plus ``z_loss * lse**2`` per counted token.

    ``mean`` divides by the number of tokens not ignored (NaN when every token is ignored, as
    torch). A label outside ``[0, vocab)`` that is not ``ignore_index`` makes its token's loss
    NaN (torch raises; a traced value cannot). ``token_axes``: inside a shard_map whose tokens
    are split over these mesh axes, the sum and the count are summed over them."""
    counted = labels != ignore_index
    in_vocab = (labels >= 0) & (labels < vocab)
    per_token = lse - (1.0 - label_smoothing) * target
    if label_smoothing:
        per_token = per_token - (label_smoothing / vocab) * total
    if z_loss:
        per_token = per_token + z_loss * lse * lse
    per_token = jnp.where(counted & ~in_vocab, jnp.nan, per_token)
    per_token = jnp.where(counted, per_token, 0.0)
    if reduction == "none":
        return per_token
    summed, count = jnp.sum(per_token), jnp.sum(counted).astype(per_token.dtype)
    if token_axes:
        summed, count = jax.lax.psum((summed, count), token_axes)
    return summed if reduction == "sum" else summed / count
