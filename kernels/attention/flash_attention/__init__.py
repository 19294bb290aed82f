"""flash_attention kernel: blocked online-softmax attention (Pallas TPU), Tokamax and XLA.

Exports the torch ops (``dot_product_attention``, ``attention_with_lse``,
``attention_forward_only``, ``attention_with_dense_mask``), ``jax`` (the JAX API), ``ring``
(context-parallel ring attention) and, through ``KERNEL``, the Transformers AttentionInterface
adapter (``integrations``, with the AttentionMaskInterface entry of ``transformers_masks``) and
the Diffusers attention backend (``diffusers_backend``), imported on first use because they
import transformers / diffusers.
``flash_attn_func`` / ``flash_attn_varlen_func`` (``flash_attn_api``) are flash-attn's entry
points, which Transformers' hub attention (``attn_implementation="kernel-hub/attention"``) looks
up on the build's top-level module (not declared in ``KERNEL``: its ``integrations`` slots are
adapters kernel-hub registers, and Transformers reads these by attribute name).
"""

from kernel_hub.kernel_api import KernelDeclaration, submodule_loader

from . import api as jax
from . import benchmark, ring
from .flash_attn_api import flash_attn_func, flash_attn_varlen_func
from .torch_api import (
    attention_forward_only,
    attention_with_dense_mask,
    attention_with_lse,
    dot_product_attention,
)

KERNEL = KernelDeclaration(
    ops={
        "attention_with_lse": attention_with_lse,
        "attention_forward_only": attention_forward_only,
        "attention_with_dense_mask": attention_with_dense_mask,
    },
    jax=jax,
    implementation_tables=(jax.TABLE,),
    integrations={
        "transformers": submodule_loader(__name__, "integrations"),
        "diffusers": submodule_loader(__name__, "diffusers_backend"),
    },
    mesh_cases=benchmark.mesh_cases,
    benchmark_cases=benchmark.CASES,
    torch_implementations=benchmark.TORCH_IMPLEMENTATIONS,
)

__all__ = [
    "KERNEL",
    "attention_forward_only",
    "attention_with_dense_mask",
    "attention_with_lse",
    "benchmark",
    "dot_product_attention",
    "flash_attn_func",
    "flash_attn_varlen_func",
    "jax",
    "ring",
]
