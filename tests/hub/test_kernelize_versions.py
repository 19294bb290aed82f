"""kernelize under kernel_mapping({op: version}) loads that hub build (served on 127.0.0.1)."""

from __future__ import annotations

import copy

import torch

from kernel_hub import kernel_mapping, kernelize
from kernel_hub.models.demo import demo_batch
from kernel_hub.models.tiny import build_tiny_model


def test_kernel_mapping_version_loads_that_hub_build(publish, hub_env):
    publish("1.0.0")
    publish("1.1.0")
    stock = build_tiny_model("llama")
    model = copy.deepcopy(stock)
    with kernel_mapping({"RMSNorm": "1.0.0"}):
        report = kernelize(model)
    assert {e.swapped_to for e in report.swapped} == {"rmsnorm 1.0.0 layers.RMSNorm"}
    assert len(report.swapped) == 5
    with kernel_mapping({"rmsnorm": ">=1.1,<2"}):
        report = kernelize(model)
    assert {e.swapped_to for e in report.swapped} == {"rmsnorm 1.1.0 layers.RMSNorm"}
    batch = demo_batch()
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).logits, stock(**batch).logits, rtol=0, atol=1e-4)

    with kernel_mapping({"rmsnorm": 2}):
        report = kernelize(model)
    assert not report.swapped
    assert "versions that exist: 1.0.0, 1.1.0" in report.entries[0].reason
