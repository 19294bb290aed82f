"""rmsnorm kernel: ``rms_norm`` torch op, ``jax.rms_norm``, ``layers.RMSNorm``."""

from kernel_hub.kernel_api import KernelDeclaration

from . import api as jax
from . import benchmark, layers, sharding
from .torch_ops import rms_norm

KERNEL = KernelDeclaration(
    ops={"rms_norm": rms_norm},
    jax=jax,
    implementation_tables=(jax.TABLE,),
    layers={
        "RMSNorm": layers.RMSNorm,
        "RMSNormF32Scale": layers.RMSNormF32Scale,
        "RMSNormZeroCentered": layers.RMSNormZeroCentered,
        "TorchRMSNorm": layers.TorchRMSNorm,
        "DiffusersRMSNorm": layers.DiffusersRMSNorm,
    },
    module_checks=layers.MODULE_CHECKS,
    mesh_cases=sharding.mesh_cases,
    benchmark_cases=benchmark.CASES,
    torch_implementations=benchmark.TORCH_IMPLEMENTATIONS,
)

__all__ = ["KERNEL", "benchmark", "jax", "layers", "rms_norm"]
