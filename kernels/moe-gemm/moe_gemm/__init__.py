"""moe-gemm kernel: grouped matmuls for mixture-of-experts layers.

Torch ops ``gmm`` / ``tgmm`` and ``gmm_quantized`` (int8 / fp8 expert weights), their JAX
functions in ``jax``, token routing helpers in
``routing``, the expert-parallel layer in ``expert_parallel``, the Transformers experts
integration in ``integrations`` and ``layers.MoEExperts``.
"""

from kernel_hub.kernel_api import KernelDeclaration

from . import api as jax
from . import benchmark, expert_parallel, integrations, layers, routing

gmm = jax.gmm.torch
gmm_quantized = jax.gmm_quantized.torch
tgmm = jax.tgmm.torch

KERNEL = KernelDeclaration(
    ops={"gmm": gmm, "tgmm": tgmm, "gmm_quantized": gmm_quantized},
    jax=jax,
    implementation_tables=(jax.GMM_TABLE, jax.TGMM_TABLE, jax.GMM_QUANTIZED_TABLE),
    layers={"MoEExperts": layers.MoEExperts},
    integrations={"transformers": lambda: integrations},
    mesh_cases=benchmark.mesh_cases,
    benchmark_cases=benchmark.CASES,
    torch_implementations=benchmark.TORCH_IMPLEMENTATIONS,
)

__all__ = [
    "KERNEL",
    "benchmark",
    "expert_parallel",
    "gmm",
    "gmm_quantized",
    "integrations",
    "jax",
    "layers",
    "routing",
    "tgmm",
]
