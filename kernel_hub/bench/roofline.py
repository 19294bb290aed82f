"""Roofline figures of the chips kernel-hub users run, and a measured roofline for this CPU.

A kernel call doing ``F`` FLOPs and moving ``B`` bytes cannot finish faster than
``max(F / peak_flops, B / bandwidth)`` on a chip (the roofline model). The share of the roofline a
measured time ``t`` reaches is that floor divided by ``t``. It equals both

- ``max(compute share, bandwidth share)`` with compute share ``F / t / peak_flops`` and bandwidth
  share ``B / t / bandwidth``, and
- achieved FLOP/s over the roofline's attainable FLOP/s at the call's arithmetic intensity
  ``F / B``: ``(F / t) / min(peak_flops, (F / B) * bandwidth)``,

so there is one number to report: 100 % means the call runs at the chip's limit for its kind of
work, whichever resource binds.

Accelerator figures are the vendors' published per-chip peaks (sources beside each entry); the
CPU's are measured on the spot (``cpu_chip``), because a CPU's nominal peak says little about a
shared 2-core VM.
"""

from __future__ import annotations

import functools
import time
from dataclasses import asdict, dataclass
from typing import Any

from kernel_hub.errors import UnknownNameError

_TERA = 1e12
_GIGA = 1e9
_MIB = 2**20


@dataclass(frozen=True)
class Chip:
    """Peak dense compute and memory bandwidth of one chip (one JAX device)."""

    name: str
    peak_flops: float
    """FLOP/s: dense bf16 matrix math for accelerators; the measured f32 matmul rate for a CPU."""
    memory_bandwidth: float
    """Bytes/s of the main memory (HBM on accelerators, DRAM on a CPU)."""
    vmem_bytes: int | None
    """TPU vector memory per TensorCore (what a Pallas block must fit in); None elsewhere."""
    source: str
    measured: bool = False

    @property
    def ridge_intensity(self) -> float:
        """FLOPs per byte above which a call is compute-bound on this chip."""
        return self.peak_flops / self.memory_bandwidth

    def time_floor(self, flops: float, bytes_accessed: float) -> float:
        """Fewest seconds a call with this much work can take here (the roofline)."""
        return max(flops / self.peak_flops, bytes_accessed / self.memory_bandwidth)

    def shares(self, flops: float, bytes_accessed: float, seconds: float) -> dict[str, float]:
        """Compute, bandwidth and roofline share (fractions) of a call measured at ``seconds``."""
        return {
            "compute_share": flops / seconds / self.peak_flops,
            "bandwidth_share": bytes_accessed / seconds / self.memory_bandwidth,
            "roofline_share": self.time_floor(flops, bytes_accessed) / seconds,
        }

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# VMEM per TensorCore: jax.experimental.pallas.tpu.get_tpu_info_for_chip (jax 0.10.2), which
# tests/bench/test_roofline.py checks against. Compute and HBM: the Cloud TPU system architecture
# pages, per chip.
TPU_CHIPS: dict[str, Chip] = {
    "v4": Chip(
        "TPU v4",
        275 * _TERA,
        1200 * _GIGA,
        16 * _MIB,
        "https://cloud.google.com/tpu/docs/v4 (275 TFLOP/s bf16, 32 GiB HBM2 at 1200 GB/s)",
    ),
    "v5e": Chip(
        "TPU v5e",
        197 * _TERA,
        819 * _GIGA,
        128 * _MIB,
        "https://cloud.google.com/tpu/docs/v5e (197 TFLOP/s bf16, 16 GB HBM2 at 819 GB/s)",
    ),
    "v5p": Chip(
        "TPU v5p",
        459 * _TERA,
        2765 * _GIGA,
        64 * _MIB,
        "https://cloud.google.com/tpu/docs/v5p (459 TFLOP/s bf16, 95 GB HBM2e at 2765 GB/s)",
    ),
    "v6e": Chip(
        "TPU v6e",
        918 * _TERA,
        1640 * _GIGA,
        128 * _MIB,
        "https://cloud.google.com/tpu/docs/v6e (918 TFLOP/s bf16, 32 GB HBM at 1640 GB/s)",
    ),
}

# NVIDIA datasheets list bf16 Tensor Core figures "with sparsity"; dense is half of that.
_H100_SHEET = "NVIDIA H100 Tensor Core GPU datasheet"
_H200_SHEET = "NVIDIA H200 Tensor Core GPU datasheet"
GPU_CHIPS: dict[str, Chip] = {
    "h100-sxm": Chip(
        "NVIDIA H100 SXM",
        989.5 * _TERA,
        3350 * _GIGA,
        None,
        f"{_H100_SHEET} (bf16 1979 TFLOP/s with sparsity, 80 GB HBM3 at 3.35 TB/s)",
    ),
    "h100-pcie": Chip(
        "NVIDIA H100 PCIe",
        756.5 * _TERA,
        2000 * _GIGA,
        None,
        f"{_H100_SHEET} (bf16 1513 TFLOP/s with sparsity, 80 GB HBM2e at 2 TB/s)",
    ),
    "h100-nvl": Chip(
        "NVIDIA H100 NVL",
        835.5 * _TERA,
        3900 * _GIGA,
        None,
        f"{_H100_SHEET} (bf16 1671 TFLOP/s with sparsity, 94 GB HBM3 at 3.9 TB/s)",
    ),
    "h200-sxm": Chip(
        "NVIDIA H200 SXM",
        989.5 * _TERA,
        4800 * _GIGA,
        None,
        f"{_H200_SHEET} (bf16 1979 TFLOP/s with sparsity, 141 GB HBM3e at 4.8 TB/s)",
    ),
    "h200-nvl": Chip(
        "NVIDIA H200 NVL",
        835.5 * _TERA,
        4800 * _GIGA,
        None,
        f"{_H200_SHEET} (bf16 1671 TFLOP/s with sparsity, 141 GB HBM3e at 4.8 TB/s)",
    ),
}

CHIPS: dict[str, Chip] = {**TPU_CHIPS, **GPU_CHIPS}


def chip(name: str) -> Chip:
    """A chip of the table by key (v4, v5e, v5p, v6e, h100-sxm, h100-pcie, h200-sxm, ...)."""
    if name not in CHIPS:
        raise UnknownNameError("chip", name, CHIPS)
    return CHIPS[name]


def gpu_chip_key(device_kind: str) -> str | None:
    """Table key for a CUDA device name ('NVIDIA H100 80GB HBM3' -> 'h100-sxm'); None if unknown."""
    kind = device_kind.upper()
    for model in ("H100", "H200"):
        if model not in kind:
            continue
        if "NVL" in kind:
            return f"{model.lower()}-nvl"
        if "PCIE" in kind:
            return f"{model.lower()}-pcie"
        return f"{model.lower()}-sxm"
    return None


# CPU probes: big enough to leave the caches and amortise timer overhead, small enough to take
# well under a second each on 2 cores.
_COPY_BYTES = 128 * _MIB
_MATMUL_SIZE = 1024
_PROBE_REPEATS = 5


def _best_seconds(fn, repeats: int) -> float:
    fn()  # warm-up: page faults, thread pool start
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_memory_bandwidth() -> float:
    """Bytes/s of a large numpy copy (STREAM 'copy' convention: read and write bytes counted),
    the better of one thread and one thread per core: on a loaded host the single thread wins.
    """
    import os
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    workers = os.cpu_count() or 1
    source = np.ones(_COPY_BYTES // 4, dtype=np.float32)
    target = np.empty_like(source)
    pairs = list(zip(np.array_split(target, workers), np.array_split(source, workers), strict=True))
    single = _best_seconds(lambda: np.copyto(target, source), _PROBE_REPEATS)
    with ThreadPoolExecutor(workers) as pool:  # numpy releases the GIL while copying
        split = _best_seconds(
            lambda: list(pool.map(lambda pair: np.copyto(*pair), pairs)), _PROBE_REPEATS
        )
    return 2 * source.nbytes / min(single, split)


def measure_matmul_flops() -> float:
    """FLOP/s of a square f32 numpy (BLAS) matmul on all cores."""
    import numpy as np

    n = _MATMUL_SIZE
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    seconds = _best_seconds(lambda: a @ a, _PROBE_REPEATS)
    return 2 * n**3 / seconds


@functools.cache
def cpu_chip() -> Chip:
    """This CPU's roofline, measured once per process (best of several runs of each probe).

    Best-of-N keeps other processes' noise out of the peak; on a loaded machine the peak is still
    underestimated, which makes shares look higher than on an idle one. A call whose working set
    stays in the caches can exceed 100 % of this main-memory roofline.
    """
    import os

    flops = measure_matmul_flops()
    bandwidth = measure_memory_bandwidth()
    return Chip(
        f"CPU ({os.cpu_count()} cores)",
        flops,
        bandwidth,
        None,
        f"measured here: {_MATMUL_SIZE}x{_MATMUL_SIZE} f32 numpy matmul, "
        f"{_COPY_BYTES // _MIB} MiB numpy copy on 1 or {os.cpu_count()} threads; "
        f"best of {_PROBE_REPEATS}",
        measured=True,
    )


def chip_for_device(device: Any) -> Chip | None:
    """Roofline of a JAX device: the table for TPUs and known GPUs, measured for CPUs."""
    from kernel_hub.platform import platform_of_jax_device, tpu_generation

    platform = platform_of_jax_device(device)
    if platform == "cpu":
        return cpu_chip()
    key = tpu_generation(device) if platform == "tpu" else gpu_chip_key(device.device_kind)
    return CHIPS.get(key) if key is not None else None
