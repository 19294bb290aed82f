"""Tiny Llama, Mixtral and Qwen3-MoE, kernelized with whatever the in-tree registry provides.

Each check compares with the stock model (f32, random weights): logits, one training step,
greedy generation, torch.compile with no graph break, and unkernelize bit for bit.
"""

from __future__ import annotations

import copy

import pytest
import torch

from kernel_hub import get_kernel, kernelize, unkernelize
from kernel_hub.models.demo import demo_batch, greedy
from kernel_hub.models.tiny import build_tiny_model

from .kernelize_helpers import (
    TOLERANCE,
    assert_registry_fully_used,
    max_masked_diff,
    swapped_modules,
)

MODELS = ["llama", "mixtral", "qwen3_moe"]


@pytest.fixture(params=MODELS)
def stock_and_copy(request: pytest.FixtureRequest) -> tuple[torch.nn.Module, torch.nn.Module]:
    stock = build_tiny_model(request.param)
    return stock, copy.deepcopy(stock)


def test_logits_match_stock(stock_and_copy) -> None:
    stock, model = stock_and_copy
    assert_registry_fully_used(kernelize(model, mode="inference"))
    batch = demo_batch()
    with torch.no_grad():
        logits, expected = model(**batch).logits, stock(**batch).logits
    assert max_masked_diff(logits, expected, batch["attention_mask"]) <= TOLERANCE


def _training_step(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    loss = model(**batch, labels=labels).loss
    loss.backward()
    optimizer.step()
    return loss.detach()


def test_training_step_matches_stock(stock_and_copy) -> None:
    stock, model = stock_and_copy
    stock.train()
    model.train()
    assert_registry_fully_used(kernelize(model, mode="training"))
    batch = demo_batch()
    torch.testing.assert_close(
        _training_step(model, batch), _training_step(stock, batch), rtol=0, atol=TOLERANCE
    )
    updated, expected = dict(model.named_parameters()), dict(stock.named_parameters())
    moved = 0
    for name, param in expected.items():
        torch.testing.assert_close(updated[name], param, rtol=0, atol=TOLERANCE, msg=name)
        moved += int(param.grad is not None and param.grad.abs().max() > 0)
    assert moved == len(expected)  # every parameter, norms included, got a gradient


def test_greedy_generation_identical(stock_and_copy) -> None:
    stock, model = stock_and_copy
    assert_registry_fully_used(kernelize(model, mode="inference"))
    batch = demo_batch()
    with torch.no_grad():
        assert torch.equal(greedy(model, batch, 8), greedy(stock, batch, 8))


def test_torch_compile_fullgraph(stock_and_copy) -> None:
    stock, model = stock_and_copy
    report = kernelize(model, mode="inference+torch_compile")
    assert_registry_fully_used(report)
    graphs = []

    def recording_backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=recording_backend)
    batch = demo_batch()
    with torch.no_grad():
        diff = max_masked_diff(
            compiled(**batch).logits, stock(**batch).logits, batch["attention_mask"]
        )
    assert diff <= TOLERANCE
    assert len(graphs) == 1  # fullgraph=True raises on a graph break; one graph, no fallback
    for op in {e.op for e in report.swapped}:  # each kernel used has a torch op in the graph
        kernel = get_kernel(op)
        names = [getattr(kernel, name).qualname.replace("::", ".") for name in kernel.manifest.ops]
        assert any(f"torch.ops.{name}" in graphs[0].code for name in names), (op, names)


def test_unkernelize_is_bit_identical(stock_and_copy) -> None:
    stock, model = stock_and_copy
    batch = demo_batch()
    config_before = copy.deepcopy(model.config.to_dict())
    report = kernelize(model, mode="inference")
    with torch.no_grad():
        model(**batch)
    restored = unkernelize(model)
    assert len(restored) == len({e.module for e in report.swapped if e.kind == "layer"}) + len(
        {e.kind for e in report.swapped if e.kind != "layer"}
    )
    assert swapped_modules(model) == []
    assert model.config.to_dict() == config_before
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, stock(**batch).logits)
