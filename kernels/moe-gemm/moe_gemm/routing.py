"""Token routing around the grouped matmuls, in plain torch with static shapes.

Every shape here depends only on the number of tokens, top-k and the number of experts, never on
where tokens go, so ``torch.compile(fullgraph=True)`` traces it without a graph break. Expert ids
outside [0, ``num_experts``) (expert-parallel sentinels) sort to the end and are left out of
``group_sizes``: ``gmm`` gives zeros for those rows, and they take no expert's bias.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Routing(NamedTuple):
    """Where each (token, slot) pair goes once the pairs are sorted by expert."""

    order: torch.Tensor
    """[T * k] flat (token, slot) index of each sorted row."""
    expert_ids: torch.Tensor
    """[T * k] expert of each sorted row (ascending)."""
    group_sizes: torch.Tensor
    """[E] int32 rows per expert."""


def _sentinels_last(expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The ids flat, a negative one made the sentinel ``num_experts`` (ids >= it are sentinels
    already): it would otherwise sort first and count as expert 0's."""
    flat = expert_ids.reshape(-1)
    return flat.masked_fill(flat < 0, num_experts)


def group_sizes(expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Rows per expert as int32 [num_experts]; ids outside [0, num_experts) are not counted."""
    ids = _sentinels_last(expert_ids, num_experts).clamp(max=num_experts).to(torch.int64)
    counts = torch.zeros(num_experts + 1, dtype=torch.int32, device=ids.device)
    counts.scatter_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
    return counts[:num_experts]


def route(top_k_index: torch.Tensor, num_experts: int) -> Routing:
    """Sort the [T, k] expert choices by expert (stable: ties keep token order). An id outside
    [0, num_experts) is a sentinel: its rows sort to the end and are computed by no expert."""
    flat = _sentinels_last(top_k_index, num_experts)
    expert_ids, order = torch.sort(flat, stable=True)
    return Routing(order, expert_ids, group_sizes(flat, num_experts))


def gather_tokens(hidden_states: torch.Tensor, routing: Routing, top_k: int) -> torch.Tensor:
    """[T, H] -> [T * k, H]: one row per (token, slot) pair, in expert order."""
    return hidden_states[routing.order // top_k]


def combine(
    expert_out: torch.Tensor, routing: Routing, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """[T * k, H] rows in expert order -> [T, H]: weight each row by its router weight, put it
    back in (token, slot) order and sum the k slots of each token."""
    tokens, top_k = top_k_weights.shape
    weights = top_k_weights.reshape(-1)[routing.order]
    weighted = expert_out * weights.unsqueeze(-1)
    unsorted = torch.zeros_like(weighted).index_copy(0, routing.order, weighted)
    return unsorted.view(tokens, top_k, -1).sum(dim=1)
