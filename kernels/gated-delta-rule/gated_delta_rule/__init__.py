"""gated-delta-rule kernel: ``chunk_gated_delta_rule`` and ``recurrent_gated_delta_rule`` torch
ops and JAX functions (``jax``)."""

from kernel_hub.kernel_api import KernelDeclaration

from . import api as jax
from . import benchmark, layers

chunk_gated_delta_rule = jax.chunk_gated_delta_rule.torch
recurrent_gated_delta_rule = jax.recurrent_gated_delta_rule.torch

KERNEL = KernelDeclaration(
    ops={
        "chunk_gated_delta_rule": chunk_gated_delta_rule,
        "recurrent_gated_delta_rule": recurrent_gated_delta_rule,
    },
    jax=jax,
    implementation_tables=(jax.CHUNK_TABLE, jax.DECODE_TABLE),
    layers={"GatedDeltaNet": layers.GatedDeltaNet},
    module_checks=layers.MODULE_CHECKS,
    mesh_cases=benchmark.mesh_cases,
    benchmark_cases=benchmark.CASES,
    torch_implementations=benchmark.TORCH_IMPLEMENTATIONS,
)

__all__ = [
    "KERNEL",
    "benchmark",
    "chunk_gated_delta_rule",
    "jax",
    "layers",
    "recurrent_gated_delta_rule",
]
