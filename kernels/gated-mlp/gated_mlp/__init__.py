"""gated-mlp kernel: ``gated_activation`` torch op, ``jax.gated_activation``,
the gated MLP layers (``layers``)."""

from kernel_hub.kernel_api import KernelDeclaration

from . import api as jax
from . import benchmark, layers

gated_activation = jax.gated_activation.torch

KERNEL = KernelDeclaration(
    ops={"gated_activation": gated_activation},
    jax=jax,
    implementation_tables=(jax.TABLE,),
    layers={
        "GatedMLP": layers.GatedMLP,
        "FusedGatedMLP": layers.FusedGatedMLP,
        "GatedMLPActivationFn": layers.GatedMLPActivationFn,
        "ScaledGatedMLP": layers.ScaledGatedMLP,
    },
    module_checks=layers.MODULE_CHECKS,
    mesh_cases=benchmark.mesh_cases,
    benchmark_cases=benchmark.CASES,
    torch_implementations=benchmark.TORCH_IMPLEMENTATIONS,
)

__all__ = ["KERNEL", "benchmark", "gated_activation", "jax", "layers"]
