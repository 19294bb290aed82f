"""Function slots are filled per module, only where a swapped kernel layer's forward declares it
reads them; stock forwards calling the module-level function are reported unreached."""

from __future__ import annotations

import pytest
import torch

from kernel_hub.errors import KernelHubError
from kernel_hub.layers import swaps
from kernel_hub.layers.integrations.function_slots import FunctionSlotInterface
from kernel_hub.layers.integrations.transformers import _forward_reads


def stock_fn(x):
    return x


class Stock(torch.nn.Module):
    def forward(self, x):
        return stock_fn(x)


def layer_forward(self, x):
    return self.__dict__.get("stock_fn", stock_fn)(x)


layer_forward.function_slots = ("stock_fn",)


def filled(x):
    return x + 1


def test_slots_are_filled_only_where_a_swapped_layer_reads_them():
    model = torch.nn.Sequential(Stock(), Stock())
    swaps.install(model[0], swaps.LayerSwap("Layer", "kernel 1.0.0", layer_forward))
    slots = FunctionSlotInterface(("stock_fn",), "op", "Slots", calls_global=_forward_reads)
    assert [name for name, m in model.named_modules() if slots.dispatches(m)] == ["0"]
    assert [name for name, _, reason in slots.unreached(model) if "module-level" in reason] == ["1"]
    assert slots.current(model) == {"": None}
    label = slots.switch(model, {"stock_fn": filled})
    assert model[0].__dict__["stock_fn"] is filled and "stock_fn" not in model[1].__dict__
    assert slots.current(model) == {"": label} and "filled" in label
    assert model(torch.zeros(2)).tolist() == [1.0, 1.0]
    slots.restore(model, {"": None})
    assert slots.current(model) == {"": None}
    with pytest.raises(KernelHubError, match="for exactly stock_fn"):
        slots.switch(model, {"other": filled})
