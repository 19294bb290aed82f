"""The loss's collectives under a vocabulary split (the sharding rules are declared with the
functions in ``api``): each shard computes its block's log-sum-exp, target logit (only the shard
owning the label picks one) and logit sum, and ``combine_vocab_shards`` merges them exactly: a max
and a sum all-reduce for the log-sum-exp, a sum for the other two."""

import jax
import jax.numpy as jnp

from .reference import NO_TARGET

Axes = tuple[str, ...]


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
