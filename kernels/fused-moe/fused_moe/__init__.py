"""fused-moe kernel: the MoE layer fused for serving (forward only).

Torch ops ``fused_experts`` / ``fused_moe``, their JAX functions in ``jax``, top-k routing in
``routing``, quantized weight formats in ``quant`` (JAX) and ``quantized`` (torch modules), the
Transformers experts integration in ``integrations`` (with ``quantize_experts``),
``layers.FusedMoEExperts``, and expert parallelism for decode in ``expert_parallel``.
"""

from kernel_hub.kernel_api import KernelDeclaration, submodule_loader

from . import api as jax
from . import benchmark, expert_parallel, layers, quant, routing

fused_experts = jax.fused_experts.torch
fused_moe = jax.fused_moe.torch

KERNEL = KernelDeclaration(
    ops={"fused_experts": fused_experts, "fused_moe": fused_moe},
    jax=jax,
    implementation_tables=(jax.TABLE,),
    layers={"FusedMoEExperts": layers.FusedMoEExperts},
    integrations={"transformers": submodule_loader(__name__, "integrations")},
    mesh_cases=benchmark.mesh_cases,
    benchmark_cases=benchmark.CASES,
    torch_implementations=benchmark.TORCH_IMPLEMENTATIONS,
)

__all__ = [
    "KERNEL",
    "benchmark",
    "expert_parallel",
    "fused_experts",
    "fused_moe",
    "jax",
    "layers",
    "quant",
    "routing",
]
