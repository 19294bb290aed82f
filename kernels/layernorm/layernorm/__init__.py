"""layernorm kernel: ``layer_norm*`` torch ops, ``jax.layer_norm``, ``layers.LayerNorm``."""

from kernel_hub.kernel_api import KernelDeclaration

from . import api as jax
from . import benchmark, layers
from .layers import layer_norm_any

layer_norm = jax.layer_norm.torch
layer_norm_no_affine = jax.layer_norm_no_affine.torch
layer_norm_no_bias = jax.layer_norm_no_bias.torch

KERNEL = KernelDeclaration(
    ops={
        "layer_norm": layer_norm,
        "layer_norm_no_affine": layer_norm_no_affine,
        "layer_norm_no_bias": layer_norm_no_bias,
    },
    jax=jax,
    implementation_tables=(jax.TABLE,),
    layers={"LayerNorm": layers.LayerNorm, "FP32LayerNorm": layers.FP32LayerNorm},
    module_checks=layers.MODULE_CHECKS,
    mesh_cases=benchmark.mesh_cases,
    benchmark_cases=benchmark.CASES,
    torch_implementations=benchmark.TORCH_IMPLEMENTATIONS,
)

__all__ = [
    "KERNEL",
    "benchmark",
    "jax",
    "layer_norm",
    "layer_norm_any",
    "layer_norm_no_affine",
    "layer_norm_no_bias",
    "layers",
]
