"""Chip table and roofline arithmetic."""

import pytest
from jax.experimental.pallas import tpu as pltpu

from kernel_hub.bench.roofline import CHIPS, TPU_CHIPS, Chip, chip, cpu_chip, gpu_chip_key
from kernel_hub.errors import UnknownNameError

# TensorCores JAX folds into one device per generation (megacore on v4 and v5p).
CORES_PER_DEVICE = {"v4": 2, "v5e": 1, "v5p": 2, "v6e": 1}


@pytest.mark.parametrize("generation", ["v4", "v5e", "v5p", "v6e"])
def test_tpu_figures_agree_with_jax(generation):
    info = pltpu.get_tpu_info_for_chip(pltpu.ChipVersion(generation), CORES_PER_DEVICE[generation])
    entry = TPU_CHIPS[generation]
    assert entry.vmem_bytes == info.vmem_capacity_bytes
    # JAX's figures are per TensorCore; the published ones per chip
    assert entry.peak_flops == pytest.approx(
        info.bf16_ops_per_second * CORES_PER_DEVICE[generation], rel=0.01
    )


def test_table_covers_the_chips_users_run():
    for key in ("v4", "v5e", "v5p", "v6e", "h100-sxm", "h100-pcie", "h200-sxm"):
        entry = chip(key)
        assert entry.peak_flops > 1e14 and entry.memory_bandwidth > 5e11 and entry.source
    with pytest.raises(UnknownNameError, match="v5e"):
        chip("v5")


@pytest.mark.parametrize(
    ("device_kind", "key"),
    [
        ("NVIDIA H100 80GB HBM3", "h100-sxm"),
        ("NVIDIA H100 PCIe", "h100-pcie"),
        ("NVIDIA H100 NVL", "h100-nvl"),
        ("NVIDIA H200", "h200-sxm"),
        ("NVIDIA H200 NVL", "h200-nvl"),
        ("NVIDIA A100-SXM4-80GB", None),
    ],
)
def test_gpu_names_map_to_table_keys(device_kind, key):
    assert gpu_chip_key(device_kind) == key
    assert key is None or key in CHIPS


def test_roofline_share_is_the_binding_resource():
    toy = Chip("toy", peak_flops=100.0, memory_bandwidth=10.0, vmem_bytes=None, source="test")
    # memory-bound: 50 flops, 100 bytes in 20 s -> floor max(0.5, 10) = 10 s -> 50 %
    shares = toy.shares(50, 100, 20.0)
    assert shares == pytest.approx(
        {"compute_share": 0.025, "bandwidth_share": 0.5, "roofline_share": 0.5}
    )
    # compute-bound: 1000 flops, 10 bytes in 20 s -> floor 10 s -> 50 %
    assert toy.shares(1000, 10, 20.0)["roofline_share"] == pytest.approx(0.5)
    # the same number as achieved over attainable FLOP/s at this intensity
    flops, moved, seconds = 300.0, 60.0, 8.0
    attainable = min(toy.peak_flops, flops / moved * toy.memory_bandwidth)
    assert toy.shares(flops, moved, seconds)["roofline_share"] == pytest.approx(
        flops / seconds / attainable
    )
    assert toy.ridge_intensity == 10.0


def test_cpu_roofline_is_measured_once_per_process():
    first = cpu_chip()
    assert first.measured and first.peak_flops > 1e8 and first.memory_bandwidth > 1e8
    assert cpu_chip() is first
