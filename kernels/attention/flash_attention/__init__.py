"""flash_attention kernel: blocked online-softmax attention (Pallas TPU), Tokamax and XLA.

Exports the torch ops (``dot_product_attention``, ``attention_with_lse``,
``attention_with_dense_mask``), ``jax`` (the JAX API), ``ring`` (context-parallel ring attention)
and, through ``KERNEL``, the Transformers AttentionInterface adapter (``integrations``, with the
AttentionMaskInterface entry of ``transformers_masks``) and the Diffusers attention backend
(``diffusers_backend``), imported on first use because they import transformers / diffusers.
"""

from kernel_hub.kernel_api import KernelDeclaration, submodule_loader

from . import api as jax
from . import benchmark, ring, sharding
from .torch_ops import attention_with_dense_mask, attention_with_lse, dot_product_attention

KERNEL = KernelDeclaration(
    ops={
        "attention_with_lse": attention_with_lse,
        "attention_with_dense_mask": attention_with_dense_mask,
    },
    jax=jax,
    implementation_tables=(jax.TABLE,),
    integrations={
        "transformers": submodule_loader(__name__, "integrations"),
        "diffusers": submodule_loader(__name__, "diffusers_backend"),
    },
    mesh_cases=sharding.mesh_cases,
    benchmark_cases=benchmark.CASES,
    torch_implementations=benchmark.TORCH_IMPLEMENTATIONS,
)

__all__ = [
    "KERNEL",
    "attention_with_dense_mask",
    "attention_with_lse",
    "benchmark",
    "dot_product_attention",
    "jax",
    "ring",
]
