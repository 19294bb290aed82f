"""Which device we are on: platform (tpu/gpu/cpu), TPU generation, torch runtime of a tensor.

Nothing here imports jax or torch at module import; they are imported on first use.
"""

from __future__ import annotations

from typing import Any, Literal

Platform = Literal["tpu", "gpu", "cpu"]
PLATFORMS: tuple[Platform, ...] = ("tpu", "gpu", "cpu")

# torch ``device.type`` -> platform whose kernels run for it.
TORCH_DEVICE_PLATFORMS: dict[str, Platform] = {
    "cpu": "cpu",
    "cuda": "gpu",
    "tpu": "tpu",  # TorchTPU (torch_tpu)
    "jax": "tpu",  # torchax; its arrays live wherever JAX runs, see ``torchax_platform``
    "xla": "tpu",  # PyTorch/XLA
}

# JAX ``device_kind`` strings -> the generation names users know.
_TPU_KINDS: dict[str, str] = {
    "TPU v4": "v4",
    "TPU v4 lite": "v4i",
    "TPU v5 lite": "v5e",
    "TPU v5e": "v5e",
    "TPU v5": "v5p",
    "TPU v5p": "v5p",
    "TPU v6 lite": "v6e",
    "TPU v6e": "v6e",
    "TPU7x": "tpu7x",
    "TPU v7": "tpu7x",  # TorchTPU's name for it
}


def platform_of_jax_device(device: Any) -> Platform:
    """Platform of a ``jax.Device`` ('cuda'/'rocm' count as gpu)."""
    name = device.platform
    if name in ("cuda", "rocm", "gpu"):
        return "gpu"
    if name == "tpu":
        return "tpu"
    return "cpu"


def jax_default_device() -> Any:
    """The device JAX computations go to now, honouring ``with jax.default_device(...)``."""
    import jax

    configured = jax.config.jax_default_device
    if configured is not None and not isinstance(configured, str):
        return configured
    backend = configured if isinstance(configured, str) else None
    return jax.devices(backend)[0]


def jax_platform() -> Platform:
    """Platform that JAX code traced right now will run on."""
    return platform_of_jax_device(jax_default_device())


def tpu_generation(device: Any) -> str:
    """'v5e' for a TPU v5 lite device, etc.; the raw device kind if unknown."""
    return tpu_generation_of_kind(device.device_kind)


def tpu_generation_of_kind(kind: str) -> str:
    """'v5e' for 'TPU v5 lite' or 'TPU v5e' (JAX's and TorchTPU's names); ``kind`` if unknown."""
    return _TPU_KINDS.get(kind, kind)


def host_platform() -> Platform:
    """Best accelerator JAX can see on this machine."""
    import jax

    return platform_of_jax_device(jax.devices()[0])


def describe_host() -> dict[str, str]:
    """Short machine description for reports and benchmark files."""
    import platform as std_platform

    import jax

    device = jax.devices()[0]
    kind = tpu_generation(device) if device.platform == "tpu" else device.device_kind
    return {
        "platform": platform_of_jax_device(device),
        "device_kind": kind,
        "device_count": str(jax.device_count()),
        "machine": std_platform.machine(),
        "processor": std_platform.processor() or std_platform.machine(),
    }


def accelerator_present() -> bool:
    """Whether this host has TPU chips (``/dev/accel*``, ``/dev/vfio/N``) or an NVIDIA GPU, seen
    without starting JAX: libtpu's start-up on a host with none prints errors nobody asked for."""
    import glob

    patterns = ("/dev/accel*", "/dev/vfio/[0-9]*", "/dev/nvidia[0-9]*")
    return any(glob.glob(pattern) for pattern in patterns)
