"""Attention and MoE experts switched through Transformers' interfaces by a registry kernel's
``integrations.register()``; tested with throwaway kernels in a tmp registry."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from kernel_hub import get_kernel, kernelize, unkernelize
from kernel_hub.models.demo import demo_batch, greedy
from kernel_hub.models.tiny import build_tiny_model

from .kernelize_helpers import (
    TmpHub,
    attention_kernel,
    declaring,
    experts_kernel,
    max_masked_diff,
)


def attention_hub(hub: TmpHub, **options: object) -> Path:
    hub.add_kernel("attention", attention_kernel(**options))
    return hub.write_registry({"attention": {}})


def interface_entries(report, kind: str) -> list:
    return [e for e in report.entries if e.kind == kind]


def test_attention_is_switched_and_restored(tmp_hub: TmpHub) -> None:
    registry = attention_hub(tmp_hub)
    stock = build_tiny_model("llama")
    model = copy.deepcopy(stock)
    report = kernelize(model, registry=registry)
    entries = interface_entries(report, "attention")
    assert [e.module for e in entries] == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert all(e.swapped and e.op == "attention" for e in entries)
    assert "'kernel_hub_test_attention' (was 'sdpa')" in entries[0].swapped_to
    assert model.config._attn_implementation == "kernel_hub_test_attention"

    calls = get_kernel("attention", registry=registry).integrations.CALLS
    batch = demo_batch()
    with torch.no_grad():
        logits = model(**batch).logits
        assert len(calls) == 2  # one call per attention layer
        assert max_masked_diff(logits, stock(**batch).logits, batch["attention_mask"]) == 0
        assert torch.equal(greedy(model, batch, 6), greedy(stock, batch, 6))

    assert unkernelize(model) == ["AttentionInterface"]
    assert model.config._attn_implementation == "sdpa"
    calls.clear()
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, stock(**batch).logits)
    assert calls == []


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_experts_are_switched_and_restored(tmp_hub: TmpHub, name: str) -> None:
    tmp_hub.add_kernel("moe-gemm", experts_kernel())
    registry = tmp_hub.write_registry({"moe-gemm": {}})
    stock = build_tiny_model(name)
    model = copy.deepcopy(stock)
    report = kernelize(model, registry=registry)
    entries = interface_entries(report, "experts")
    assert len(entries) == 2 and all(e.swapped and e.op == "moe-gemm" for e in entries)
    assert "(was 'grouped_mm')" in entries[0].swapped_to
    assert model.config._experts_implementation == "kernel_hub_test_experts"
    calls = get_kernel("moe-gemm", registry=registry).integrations.CALLS
    batch = demo_batch()
    with torch.no_grad():
        logits = model(**batch).logits
        assert len(calls) == 2
        assert max_masked_diff(logits, stock(**batch).logits, batch["attention_mask"]) == 0
    unkernelize(model)
    assert model.config._experts_implementation == "grouped_mm"


@pytest.mark.parametrize(
    ("options", "mode", "reason"),
    [
        ({"register_mask": False}, "inference", "has no AttentionMaskInterface entry"),
        ({"returns": "never_registered"}, "inference", "is not registered with AttentionInterface"),
        ({"can_torch_compile": False}, "inference+torch_compile", "can_torch_compile = True"),
        ({"has_backward": False}, "training", "has no backward"),
    ],
)
def test_unusable_attention_kernels_are_left_alone(
    tmp_hub: TmpHub, options: dict, mode: str, reason: str
) -> None:
    registry = attention_hub(tmp_hub, name=f"kernel_hub_test_{len(options)}_{mode}", **options)
    model = build_tiny_model("llama")
    report = kernelize(model, mode=mode, registry=registry)
    entries = interface_entries(report, "attention")
    assert entries and not any(e.swapped for e in entries)
    assert reason in entries[0].reason
    assert model.config._attn_implementation == "sdpa"
    assert unkernelize(model) == []


def test_kernel_without_integrations(tmp_hub: TmpHub) -> None:
    tmp_hub.add_kernel("attention", {"__init__.py": declaring()})
    registry = tmp_hub.write_registry({"attention": {}})
    report = kernelize(build_tiny_model("llama"), registry=registry)
    assert "has no integrations.register()" in interface_entries(report, "attention")[0].reason


def test_part_of_a_model_cannot_switch_its_attention(tmp_hub: TmpHub) -> None:
    registry = attention_hub(tmp_hub)
    layer = build_tiny_model("llama").model.layers[0]
    report = kernelize(layer, registry=registry)
    (entry,) = interface_entries(report, "attention")
    assert "has no set_attn_implementation()" in entry.reason


def _fake_kernel(adapter: object) -> object:
    from types import SimpleNamespace

    from kernel_hub.kernel_api import KernelDeclaration

    declaration = KernelDeclaration(
        ops={}, jax=None, integrations={"transformers": lambda: adapter}
    )
    return SimpleNamespace(KERNEL=declaration, manifest=SimpleNamespace(name="k", version="1.0.0"))


@pytest.mark.parametrize(
    ("module", "interface", "function", "recorded"),
    [
        ("rotary_slot", "RotarySlotInterface", "apply_rotary", "_FUNCTIONS"),
        ("causal_lm_loss", "CausalLMLossInterface", "causal_lm_loss", "_LOSSES"),
    ],
)
def test_slots_kernel_hub_fills_read_the_whole_adapter_contract(
    module: str, interface: str, function: str, recorded: str
) -> None:
    """The rotary slot and the causal-LM loss read a kernel's adapter as every interface does (no
    attribute defaulted) and record the function its registered name stands for."""
    import importlib
    from types import SimpleNamespace

    from kernel_hub.errors import KernelHubError

    integrations = importlib.import_module(f"kernel_hub.layers.integrations.{module}")
    slot = getattr(integrations, interface)()
    fn = print
    whole = {
        "register": lambda: "k_name",
        "has_backward": False,
        "can_torch_compile": True,
        "module_problem": None,
        function: fn,
    }
    adapter = slot.integration(_fake_kernel(SimpleNamespace(**whole)))
    assert (adapter.has_backward, adapter.can_torch_compile) == (False, True)
    assert adapter.register() == "k_name" and getattr(integrations, recorded)["k_name"] is fn
    assert slot.integration(_fake_kernel(None)) is None
    partial = SimpleNamespace(**{k: v for k, v in whole.items() if k != "has_backward"})
    with pytest.raises(KernelHubError, match=r"k 1\.0\.0 integrations lacks has_backward"):
        slot.integration(_fake_kernel(partial))
    lacking = SimpleNamespace(**{k: v for k, v in whole.items() if k != function})
    with pytest.raises(KernelHubError, match=f"lacks the function {function}"):
        slot.integration(_fake_kernel(lacking))
