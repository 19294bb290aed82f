"""A tiny Mixtral with its experts on the gmm kernel matches stock Transformers."""

from __future__ import annotations

import copy
import types
from unittest import mock

import jax
import pytest
import torch
from transformers import MixtralForCausalLM

from kernel_hub import get_kernel
from kernel_hub.models.tiny import tiny_model

moe = get_kernel("moe-gemm")

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def kernel_name():
    return moe.integrations.register()


def _use_orders(tables, orders) -> None:
    for table, order in zip(tables, orders, strict=True):
        table.set_order("cpu", order)
    jax.clear_caches()  # the implementation is chosen at trace time; traces are cached per shape


@pytest.fixture(params=["xla_loop", "pallas"])
def implementation(request):
    """Run the kernel's gmm/tgmm through one implementation on CPU for the test."""
    tables = (moe.jax.GMM_TABLE, moe.jax.TGMM_TABLE)  # gmm_quantized has its own
    saved = [table.order("cpu") for table in tables]
    _use_orders(tables, [[request.param]] * len(tables))
    yield request.param
    _use_orders(tables, saved)


def tiny_mixtral(experts_implementation: str = "eager") -> MixtralForCausalLM:
    model = tiny_model(
        MixtralForCausalLM,
        intermediate_size=96,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )
    model.set_experts_implementation(experts_implementation)
    return model


def with_kernel(model: MixtralForCausalLM, name: str) -> MixtralForCausalLM:
    kernel_model = copy.deepcopy(model)
    kernel_model.set_experts_implementation(name)
    assert kernel_model.config._experts_implementation == name
    return kernel_model


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.fixture(scope="module")
def input_ids():
    return torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("stock", ["eager", "grouped_mm"])
def test_logits_match_stock_experts(kernel_name, implementation, input_ids, stock):
    model = tiny_mixtral(stock)
    kernel_model = with_kernel(model, kernel_name)
    table, chosen = moe.jax.GMM_TABLE, []

    def recording_select(*args, **kwargs):
        selected = original_select(*args, **kwargs)
        chosen.append(selected.name)
        return selected

    original_select = table.select
    with (
        torch.no_grad(),
        mock.patch.object(moe.integrations, "gmm", wraps=moe.integrations.gmm) as gmm_calls,
        mock.patch.object(table, "select", recording_select),
    ):
        got = kernel_model(input_ids).logits
    # two layers, two grouped matmuls each, traced with the implementation under test
    assert gmm_calls.call_count == 4
    assert chosen and set(chosen) == {implementation}, chosen
    with torch.no_grad():
        expected = model(input_ids).logits
    diff = max_diff(got, expected)
    assert diff <= TOLERANCE, f"logits differ from {stock} experts by {diff:.3g}"


def test_training_step_gradients_match(kernel_name, implementation, input_ids):
    model = tiny_mixtral("eager").train()
    kernel_model = with_kernel(model, kernel_name)
    for m in (model, kernel_model):
        m.zero_grad()
        m(input_ids, labels=input_ids).loss.backward()
    expected = dict(model.named_parameters())
    for name, parameter in kernel_model.named_parameters():
        reference = expected[name].grad
        assert reference is not None and parameter.grad is not None, f"{name} has no gradient"
        diff = max_diff(parameter.grad, reference)
        assert diff <= TOLERANCE, f"grad of {name} differs by {diff:.3g}"


def test_generate_gives_the_same_greedy_tokens(kernel_name, input_ids):
    model = tiny_mixtral("eager")
    kernel_model = with_kernel(model, kernel_name)
    settings = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    expected = model.generate(input_ids, **settings)
    assert torch.equal(kernel_model.generate(input_ids, **settings), expected)


def test_compiled_forward_has_no_graph_break(kernel_name, input_ids):
    model = with_kernel(tiny_mixtral("eager"), kernel_name)
    explanation = torch._dynamo.explain(model)(input_ids, use_cache=False)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        diff = max_diff(
            compiled(input_ids, use_cache=False).logits, model(input_ids, use_cache=False).logits
        )
    assert diff == 0.0


def test_layer_swap_runs_experts_through_gmm(input_ids):
    model = tiny_mixtral("eager")
    swapped = copy.deepcopy(model)
    for module in swapped.modules():
        if type(module).__name__ == "MixtralExperts":
            module.forward = types.MethodType(moe.layers.MoEExperts.forward, module)
    with torch.no_grad():
        diff = max_diff(swapped(input_ids).logits, model(input_ids).logits)
    assert diff <= TOLERANCE
