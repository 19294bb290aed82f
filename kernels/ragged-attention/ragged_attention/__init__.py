"""ragged_attention kernel: serving attention (forward only) for many sequences at once.

Exports the torch entry points ``ragged_attention`` (packed varlen batches: chunked prefill mixed
with decode) and ``paged_attention`` (decode over Transformers' paged KV cache, read in place),
their raw ops, ``jax`` (the JAX API) and, through ``KERNEL``, the Transformers continuous-batching
adapter (imported on first use because it imports transformers).
"""

from kernel_hub.kernel_api import KernelDeclaration, submodule_loader

from . import api as jax
from . import benchmark
from .torch_api import (
    paged_attention,
    paged_attention_op,
    ragged_attention,
    ragged_attention_op,
)

KERNEL = KernelDeclaration(
    ops={"ragged_attention": ragged_attention, "paged_attention": paged_attention},
    jax=jax,
    implementation_tables=(jax.RAGGED_TABLE, jax.PAGED_TABLE),
    integrations={"transformers": submodule_loader(__name__, "integrations")},
    mesh_cases=benchmark.mesh_cases,
    benchmark_cases=benchmark.CASES,
)

__all__ = [
    "KERNEL",
    "benchmark",
    "jax",
    "paged_attention",
    "paged_attention_op",
    "ragged_attention",
    "ragged_attention_op",
]
