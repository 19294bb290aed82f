"""``hub_layer_mapping``: a ``kernels`` entry per device for every layer and function slot the
registry serves (test_hf_kernels_pinned.py loads them from a local ``kernel-hub serve``)."""

from __future__ import annotations

import pytest

from kernel_hub.errors import KernelHubError
from kernel_hub.layers.integrations.hf_kernels import DEVICES, FUNCTION_SLOTS, hub_layer_mapping
from kernel_hub.registry.registry import load_registry

kernels = pytest.importorskip("kernels")


def test_mapping_has_tpu_and_cpu_entries_for_every_served_layer() -> None:
    mapping = hub_layer_mapping()
    registry = load_registry()
    layers = {layer: (entry, layer) for entry in registry if entry.repo for layer in entry.layers}
    layers.update({slot: (registry.get(op), layer) for slot, (op, layer) in FUNCTION_SLOTS.items()})
    assert set(mapping) == set(layers)
    assert {"RMSNorm", "LayerNorm", "MoEExperts", "rotary_pos_emb"} <= set(mapping)
    for slot, by_device in mapping.items():
        assert tuple(by_device) == DEVICES
        for repository in by_device.values():
            entry, layer = layers[slot]
            assert repository.layer_name == layer
            assert repository._repo_id == entry.repo  # kernels keeps no public getter
            assert repository._version == 1  # the registry's ">=1.0,<2": branch v1
    with pytest.raises(KernelHubError, match="kernel-hub builds serve tpu, cpu"):
        hub_layer_mapping(devices=("cuda",))
