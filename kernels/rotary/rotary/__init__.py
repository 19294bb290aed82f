"""rotary kernel: ``rotary_embedding`` torch op (q and k in one call), ``jax.rotary_embedding``,
and the Transformers ``rotary_pos_emb`` slot function (``integrations.apply_rotary``)."""

from kernel_hub.kernel_api import KernelDeclaration, submodule_loader

from . import api as jax
from . import benchmark, sharding
from .torch_ops import rotary_embedding

KERNEL = KernelDeclaration(
    ops={"rotary_embedding": rotary_embedding},
    jax=jax,
    implementation_tables=(jax.TABLE,),
    integrations={"transformers": submodule_loader(__name__, "integrations")},
    mesh_cases=sharding.mesh_cases,
    benchmark_cases=benchmark.CASES,
    torch_implementations=benchmark.TORCH_IMPLEMENTATIONS,
)

__all__ = ["KERNEL", "benchmark", "jax", "rotary_embedding"]
