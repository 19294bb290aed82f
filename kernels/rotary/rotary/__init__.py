"""rotary kernel: ``rotary_embedding`` torch op (q and k in one call), ``jax.rotary_embedding``,
the Transformers ``rotary_pos_emb`` slot function (``integrations.apply_rotary``) and, for
Hugging Face ``kernels``, that slot as a layer (``layers.ApplyRotaryPosEmb``; not a kernel-hub
layer, so not in ``KERNEL.layers``: ``kernels`` reads it as ``<build>.layers.<name>``)."""

from kernel_hub.kernel_api import KernelDeclaration, submodule_loader

from . import api as jax
from . import benchmark, layers

rotary_embedding = jax.rotary_embedding.torch

KERNEL = KernelDeclaration(
    ops={"rotary_embedding": rotary_embedding},
    jax=jax,
    implementation_tables=(jax.TABLE,),
    integrations={"transformers": submodule_loader(__name__, "integrations")},
    mesh_cases=benchmark.mesh_cases,
    benchmark_cases=benchmark.CASES,
    torch_implementations=benchmark.TORCH_IMPLEMENTATIONS,
)

__all__ = ["KERNEL", "benchmark", "jax", "layers", "rotary_embedding"]
