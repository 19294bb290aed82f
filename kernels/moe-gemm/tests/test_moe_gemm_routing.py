"""Routing helpers: static-shape group sizes, sort and combine back to token order."""

from __future__ import annotations

import pytest
import torch

from kernel_hub import get_kernel

moe = get_kernel("moe-gemm")


def test_group_sizes_count_rows_per_expert_with_fixed_shape():
    ids = torch.tensor([[3, 0], [3, 1], [0, 3]])
    sizes = moe.routing.group_sizes(ids, num_experts=6)
    assert sizes.dtype == torch.int32
    assert sizes.tolist() == torch.bincount(ids.reshape(-1), minlength=6).tolist()


def test_group_sizes_leave_out_expert_parallel_sentinels():
    ids = torch.tensor([0, 4, 2, 4, 7])  # 4 and 7 are not local experts of a 4-expert shard
    assert moe.routing.group_sizes(ids, num_experts=4).tolist() == [1, 0, 1, 0]
    assert moe.routing.group_sizes(torch.tensor([-1, 2]), num_experts=4).tolist() == [0, 0, 1, 0]


def test_route_and_combine_reproduce_a_weighted_sum_per_token():
    torch.manual_seed(0)
    tokens, top_k, experts, hidden = 5, 2, 4, 3
    index = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k)
    x = torch.randn(tokens, hidden)
    routing = moe.routing.route(index, experts)
    assert torch.equal(routing.expert_ids, torch.sort(index.reshape(-1)).values)
    rows = moe.routing.gather_tokens(x, routing, top_k)
    # Stand-in expert: scale each row by (expert id + 1).
    expert_out = rows * (routing.expert_ids.unsqueeze(-1) + 1)
    out = moe.routing.combine(expert_out, routing, weights)
    expected = sum(weights[:, s, None] * x * (index[:, s, None] + 1) for s in range(top_k))
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("tokens", [3, 17])
def test_routing_compiles_without_graph_breaks(tokens):
    def routed(x, index, weights):
        routing = moe.routing.route(index, 4)
        rows = moe.routing.gather_tokens(x, routing, index.shape[-1])
        return moe.routing.combine(rows * 2, routing, weights)

    x, index = torch.randn(tokens, 8), torch.randint(0, 4, (tokens, 2))
    explanation = torch._dynamo.explain(routed)(x, index, torch.rand(tokens, 2))
    assert explanation.graph_break_count == 0, explanation.break_reasons


def test_negative_ids_sort_last_and_count_for_no_expert():
    """A -1 would sort first and be counted as expert 0's row: it is a sentinel, as ids >= E are."""
    routing = moe.routing.route(torch.tensor([[1, -1], [0, 1]]), num_experts=2)
    assert routing.group_sizes.tolist() == [1, 2]
    assert routing.expert_ids.tolist() == [0, 1, 1, 2]


def test_sentinel_slots_contribute_nothing_to_biased_experts():
    """GPT-OSS's experts carry biases: a sentinel slot (negative or >= E, with a router weight)
    adds nothing, not the last expert's biases; the same as dropping the slot."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    torch.manual_seed(0)
    config = GptOssConfig(hidden_size=64, intermediate_size=64, num_local_experts=4)
    experts = GptOssExperts(config)
    with torch.no_grad():
        for param in experts.parameters():
            param.normal_(0, 0.1)
        x, weights = torch.randn(3, 64), torch.rand(3, 2)
        kept = torch.tensor([[0, 2], [0, 3], [1, 2]])
        dropped = moe.integrations.experts_forward(experts, x, kept, weights * torch.tensor([1, 0]))
        for sentinel in (4, -1):
            ids = kept.clone()
            ids[:, 1] = sentinel
            out = moe.integrations.experts_forward(experts, x, ids, weights)
            torch.testing.assert_close(out, dropped, rtol=1e-5, atol=1e-6)
