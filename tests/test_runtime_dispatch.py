"""Choosing a runtime by device type: clear errors, lazy imports, tracing for a TPU JAX lacks."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest
import torch
from runtime_helpers import lazy_device

from kernel_hub import get_kernel
from kernel_hub.bridge.runtimes import supported_device_types, tpu_target
from kernel_hub.bridge.runtimes.tpu_program import mosaic_kernels
from kernel_hub.bridge.runtimes.tpu_target import jax_device_kind, tracing_for_tpu
from kernel_hub.errors import UnsupportedDeviceError
from kernel_hub.platform import jax_platform, tpu_generation

SUPPORTED = ("cpu", "cuda", "tpu", "jax", "xla")


def test_every_tpu_runtime_device_type_is_supported():
    assert set(SUPPORTED) <= set(supported_device_types())


@pytest.mark.parametrize("device", ["meta", "lazy"])
def test_a_device_with_no_runtime_gets_an_error_listing_the_supported_ones(device):
    k = get_kernel("rmsnorm")
    if device == "lazy":
        lazy_device()
    x, w = torch.zeros(4, 128, device=device), torch.zeros(128, device=device)
    with pytest.raises(UnsupportedDeviceError) as error:
        k.rms_norm(x, w)
    message = str(error.value)
    assert f"device type {device!r}" in message
    for device_type in SUPPORTED:
        assert device_type in message


def test_runtime_libraries_are_imported_only_when_their_tensors_arrive():
    script = textwrap.dedent(
        """
        import json, sys, torch
        from kernel_hub import get_kernel
        k = get_kernel("rmsnorm")
        k.rms_norm(torch.ones(2, 128), torch.ones(128)).sum()
        print(json.dumps(sorted(
            name for name in sys.modules
            if name.split(".")[0] in ("torchax", "torch_tpu", "torch_xla")
            or name.startswith("kernel_hub.bridge.runtimes.t")
        )))
        """
    )
    result = subprocess.run(
        [sys.executable, "-P", "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert json.loads(result.stdout.splitlines()[-1]) == []


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("TPU v5e", "TPU v5 lite"),  # TorchTPU's name
        ("TPU v5 lite", "TPU v5 lite"),  # JAX's and PJRT's name
        ("TPU v6e", "TPU v6 lite"),
        ("TPU v5p", "TPU v5"),
        ("TPU v7", "TPU7x"),
        ("TPU v99", "TPU v99"),  # unknown: kept as it is
    ],
)
def test_runtime_tpu_names_map_to_jax_device_kinds(name, kind):
    assert jax_device_kind(name) == kind


def _lowered_rms_norm(device_name: str):
    k = get_kernel("rmsnorm")
    fn = jax.jit(functools.partial(k.jax.rms_norm, eps=1e-6))
    x, w = jax.ShapeDtypeStruct((64, 256), jnp.bfloat16), jax.ShapeDtypeStruct((256,), jnp.bfloat16)
    with tracing_for_tpu(device_name):
        platform, device = jax_platform(), jax.config.jax_default_device
        traced = fn.trace(x, w)
    return platform, device, traced.lower(lowering_platforms=("tpu",))


def test_tracing_for_tpu_picks_the_pallas_kernel_on_a_cpu_host():
    platform, device, lowered = _lowered_rms_norm("TPU v6e")
    assert (platform, tpu_generation(device)) == ("tpu", "v6e")
    assert [k.name for k in mosaic_kernels(lowered.compiler_ir("stablehlo"))] == [
        "rms_norm_forward"
    ]
    assert jax_platform() == "cpu"  # only inside the block


def test_without_abstract_device_platforms_a_deviceless_libtpu_device_stands_in(monkeypatch):
    class OldAbstractDevice:  # jax releases before AbstractDevice took a platform
        def __init__(self, device_kind, num_cores=None): ...

    monkeypatch.setattr(jax.sharding, "AbstractDevice", OldAbstractDevice)
    tpu_target.tpu_target.cache_clear()
    try:
        platform, device, lowered = _lowered_rms_norm("TPU v5e")
    finally:
        tpu_target.tpu_target.cache_clear()
    assert isinstance(device, jax.Device) and tpu_generation(device) == "v5e"
    assert platform == "tpu"
    assert mosaic_kernels(lowered.compiler_ir("stablehlo"))
