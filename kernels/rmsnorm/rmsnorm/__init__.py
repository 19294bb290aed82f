"""rmsnorm kernel: ``rms_norm`` and ``gated_rms_norm`` torch ops, their JAX functions (``jax``),
the norm layers (``layers``)."""

from kernel_hub.kernel_api import KernelDeclaration

from . import api as jax
from . import benchmark, layers

rms_norm = jax.rms_norm.torch
gated_rms_norm = jax.gated_rms_norm.torch

KERNEL = KernelDeclaration(
    ops={"rms_norm": rms_norm, "gated_rms_norm": gated_rms_norm},
    jax=jax,
    implementation_tables=(jax.TABLE, jax.GATED_TABLE),
    layers={
        "RMSNorm": layers.RMSNorm,
        "RMSNormF32Scale": layers.RMSNormF32Scale,
        "RMSNormZeroCentered": layers.RMSNormZeroCentered,
        "RMSNormOfX": layers.RMSNormOfX,
        "RMSNormOptionalScale": layers.RMSNormOptionalScale,
        "TorchRMSNorm": layers.TorchRMSNorm,
        "DiffusersRMSNorm": layers.DiffusersRMSNorm,
        "RMSNormGated": layers.RMSNormGated,
        "RMSNormGatedGrouped": layers.RMSNormGatedGrouped,
    },
    module_checks=layers.MODULE_CHECKS,
    mesh_cases=benchmark.mesh_cases,
    benchmark_cases=benchmark.CASES,
    torch_implementations=benchmark.TORCH_IMPLEMENTATIONS,
)

__all__ = ["KERNEL", "benchmark", "gated_rms_norm", "jax", "layers", "rms_norm"]
