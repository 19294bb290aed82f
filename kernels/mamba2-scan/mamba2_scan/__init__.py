"""mamba2-scan kernel: the Mamba-2 scan as ``mamba_chunk_scan_combined`` (prefill, training) and
``selective_state_update`` (decode) torch ops and JAX functions (``jax``), and the
``Mamba2ScanMixer`` layer that fills Transformers' Mamba-2 function slots with them."""

from kernel_hub.kernel_api import KernelDeclaration

from . import api as jax
from . import benchmark, layers

mamba_chunk_scan_combined = jax.mamba_chunk_scan_combined.torch
selective_state_update = jax.selective_state_update.torch

KERNEL = KernelDeclaration(
    ops={
        "mamba_chunk_scan_combined": mamba_chunk_scan_combined,
        "selective_state_update": selective_state_update,
    },
    jax=jax,
    implementation_tables=(jax.CHUNK_TABLE, jax.DECODE_TABLE),
    layers={"Mamba2ScanMixer": layers.Mamba2ScanMixer},
    module_checks=layers.MODULE_CHECKS,
    mesh_cases=benchmark.mesh_cases,
    benchmark_cases=benchmark.CASES,
    torch_implementations=benchmark.TORCH_IMPLEMENTATIONS,
)

__all__ = [
    "KERNEL",
    "benchmark",
    "jax",
    "layers",
    "mamba_chunk_scan_combined",
    "selective_state_update",
]
