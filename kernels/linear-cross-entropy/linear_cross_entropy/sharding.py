"""Sharding rules of the loss and its token statistics: tokens split freely (data parallel, the
``batch`` factor), the LM head vocabulary-parallel (``vocab``, ``combined``): each shard computes
its block's log-sum-exp, target logit (only the shard owning the label picks one) and logit sum,
and ``combine_vocab_shards`` merges them exactly: a max and a sum all-reduce for the log-sum-exp,
a sum for the other two. Only [tokens] vectors cross chips, never the weight; the backward is the
shard_map's transpose (hidden's gradient summed over the vocabulary shards, the head's local)."""

import jax
import jax.numpy as jnp

from kernel_hub.kernel_api import ShardingRule, sharded

from .reference import NO_TARGET

Axes = tuple[str, ...]

TOKEN_STATISTICS = ShardingRule.parse(
    "token_statistics",
    "batch hidden, vocab hidden, vocab, batch -> batch, batch, batch",
    whole=("hidden",),
    combined=("vocab",),
)


def loss_rule(reduction: str = "mean", **_) -> ShardingRule:
    """The loss: per-token results keep the token split; a sum or mean over split tokens is
    combined by the function (a mean is the total over the count, both summed over shards)."""
    per_token = reduction == "none"
    return ShardingRule.parse(
        "linear_cross_entropy",
        "batch hidden, vocab hidden, batch, vocab -> " + ("batch" if per_token else ""),
        whole=("hidden",),
        combined=("vocab",) if per_token else ("vocab", "batch"),
    )


statistics_boundary = sharded(TOKEN_STATISTICS)
"""Decorator of ``api.token_statistics``: shard_map over the mesh its inputs are sharded on."""
loss_boundary = sharded(loss_rule)
"""Decorator of ``api.linear_cross_entropy``."""


def vocab_axes(split_axes: dict[str, Axes] | None) -> Axes:
    return (split_axes or {}).get("vocab", ())


def token_axes(split_axes: dict[str, Axes] | None) -> Axes:
    return (split_axes or {}).get("batch", ())


def local_targets(targets: jax.Array, local_vocab: int, axes: Axes) -> jax.Array:
    """Targets as ids into this shard's block of the vocabulary; NO_TARGET where another shard
    owns the label (or none does)."""
    local = targets - jax.lax.axis_index(axes) * local_vocab
    owned = (targets >= 0) & (local >= 0) & (local < local_vocab)
    return jnp.where(owned, local, NO_TARGET)


def combine_vocab_shards(lse, target, total, axes: Axes):
    """The whole vocabulary's statistics from each shard's: log-sum-exp through the max over
    shards (held constant in the gradient: the result does not depend on it), sums for the
    target logit (zero off its owner) and the logit sum."""
    peak = jax.lax.pmax(jax.lax.stop_gradient(lse), axes)
    norm, target, total = jax.lax.psum((jnp.exp(lse - peak), target, total), axes)
    return peak + jnp.log(norm), target, total
