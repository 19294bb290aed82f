"""linear-cross-entropy kernel: ``linear_cross_entropy`` torch op, ``jax.linear_cross_entropy``,
and the Transformers causal-LM integration (``integrations``)."""

from kernel_hub.kernel_api import KernelDeclaration, submodule_loader

from . import api as jax
from . import benchmark

linear_cross_entropy = jax.linear_cross_entropy.torch

KERNEL = KernelDeclaration(
    ops={"linear_cross_entropy": linear_cross_entropy},
    jax=jax,
    implementation_tables=(jax.TABLE,),
    integrations={"transformers": submodule_loader(__name__, "integrations")},
    mesh_cases=benchmark.mesh_cases,
    benchmark_cases=benchmark.CASES,
    torch_implementations=benchmark.TORCH_IMPLEMENTATIONS,
)

__all__ = ["KERNEL", "benchmark", "jax", "linear_cross_entropy"]
