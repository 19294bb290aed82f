"""causal-conv1d kernel: ``causal_conv1d`` and ``causal_conv1d_update`` torch ops and JAX
functions (``jax``)."""

from kernel_hub.kernel_api import KernelDeclaration, submodule_loader

from . import api as jax
from . import benchmark

causal_conv1d = jax.causal_conv1d.torch
causal_conv1d_update = jax.causal_conv1d_update.torch

KERNEL = KernelDeclaration(
    ops={"causal_conv1d": causal_conv1d, "causal_conv1d_update": causal_conv1d_update},
    jax=jax,
    implementation_tables=(jax.TABLE, jax.UPDATE_TABLE),
    mesh_cases=benchmark.mesh_cases,
    benchmark_cases=benchmark.CASES,
    torch_implementations=benchmark.TORCH_IMPLEMENTATIONS,
    integrations={"transformers": submodule_loader(__name__, "integrations")},
)

__all__ = ["KERNEL", "benchmark", "causal_conv1d", "causal_conv1d_update", "jax"]
