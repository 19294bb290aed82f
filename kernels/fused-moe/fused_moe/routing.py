"""Top-k routing from router logits, in JAX (runs in the same compiled program as the kernel).

Forms (Transformers' routers):

* ``scoring="softmax"``: Mixtral, Qwen3-MoE (softmax over all experts, then top-k; with
  ``renormalize`` the k weights are divided by their sum) and GPT-OSS (top-k of the logits, then a
  softmax over those k: the same weights as softmax + renormalize).
* ``scoring="sigmoid"`` with ``bias``, ``groups`` / ``top_groups`` and ``scale``: DeepSeek-V3.
  The bias only chooses experts (weights are the unbiased scores); a group's score is the sum of
  its two best biased scores; experts outside the ``top_groups`` best groups are masked with
  -inf; renormalisation adds 1e-20 to the sum; ``scale`` multiplies the weights in any case.

Scores are computed in f32 (f64 for f64 logits). Ties pick the lower expert id, as
``jax.lax.top_k`` does.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

SCORINGS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class Router:
    """How router logits become (weights, expert ids)."""

    top_k: int
    scoring: str = "softmax"
    renormalize: bool = True
    groups: int | None = None
    top_groups: int | None = None
    scale: float = 1.0

    def problem(self, num_experts: int) -> str | None:
        """Why this router cannot route over ``num_experts`` experts, or None."""
        if self.scoring not in SCORINGS:
            return f"scoring must be one of {', '.join(SCORINGS)}, got {self.scoring!r}"
        if not 1 <= self.top_k <= num_experts:
            return f"top_k={self.top_k} must be in [1, {num_experts}] (the number of experts)"
        if (self.groups is None) != (self.top_groups is None):
            return "groups and top_groups go together (grouped top-k needs both)"
        if self.groups is not None:
            if self.groups < 1 or num_experts % self.groups:
                return f"groups={self.groups} must divide the {num_experts} experts"
            per_group = num_experts // self.groups
            if per_group < 2:
                return (
                    f"grouped top-k scores a group by its two best experts; groups of {per_group}"
                )
            if not 1 <= self.top_groups <= self.groups:
                return f"top_groups={self.top_groups} must be in [1, groups={self.groups}]"
            if self.top_k > self.top_groups * per_group:
                return (
                    f"top_k={self.top_k} exceeds the {self.top_groups * per_group} experts of "
                    f"the {self.top_groups} chosen groups"
                )
        return None


def route(logits: jax.Array, router: Router, bias: jax.Array | None = None):
    """(weights [T, k] f32, ids [T, k] int32) for ``logits`` [T, E]."""
    acc = jnp.promote_types(logits.dtype, jnp.float32)
    logits = logits.astype(acc)
    tokens, num_experts = logits.shape
    if router.scoring == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
    else:
        scores = jax.nn.sigmoid(logits)
    choice = scores if bias is None else scores + bias.astype(acc)
    if router.groups is not None:
        grouped = choice.reshape(tokens, router.groups, num_experts // router.groups)
        group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)
        _, best = jax.lax.top_k(group_scores, router.top_groups)
        keep = (
            jnp.zeros((tokens, router.groups), bool).at[jnp.arange(tokens)[:, None], best].set(True)
        )
        keep = jnp.repeat(keep, num_experts // router.groups, axis=1)
        choice = jnp.where(keep, choice, -jnp.inf)
    _, ids = jax.lax.top_k(choice, router.top_k)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if router.renormalize:
        extra = 1e-20 if router.scoring == "sigmoid" else 0.0
        weights = weights / (weights.sum(-1, keepdims=True) + extra)
    return weights * router.scale, ids.astype(jnp.int32)
