"""quantized-matmul kernel: ``quantized_matmul``, a linear layer's ``x @ W^T`` with the weight
kept quantized (fp8 e4m3 in 128 x 128 blocks, int8 per output channel), and
``quantized_matmul_int4`` (GPTQ-packed int4, group 128); their JAX functions in
``jax``; ``layers.QuantizedLinear`` for kernel-hub's quantized linear layers."""

from kernel_hub.kernel_api import KernelDeclaration

from . import api as jax
from . import benchmark, layers

quantized_matmul = jax.quantized_matmul.torch
quantized_matmul_int4 = jax.quantized_matmul_int4.torch

KERNEL = KernelDeclaration(
    ops={"quantized_matmul": quantized_matmul, "quantized_matmul_int4": quantized_matmul_int4},
    jax=jax,
    implementation_tables=(jax.TABLE, jax.TABLE_INT4),
    layers={"QuantizedLinear": layers.QuantizedLinear},
    module_checks=layers.MODULE_CHECKS,
    mesh_cases=benchmark.mesh_cases,
    benchmark_cases=benchmark.CASES,
    torch_implementations=benchmark.TORCH_IMPLEMENTATIONS,
)

__all__ = ["KERNEL", "benchmark", "jax", "layers", "quantized_matmul", "quantized_matmul_int4"]
