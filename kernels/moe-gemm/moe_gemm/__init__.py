"""moe-gemm kernel: grouped matmuls for mixture-of-experts layers.

Torch ops ``gmm`` / ``tgmm``, their JAX functions in ``jax``, token routing helpers in
``routing``, the expert-parallel layer in ``expert_parallel``, the Transformers experts
integration in ``integrations`` and ``layers.MoEExperts``.
"""

from . import api as jax
from . import benchmark, expert_parallel, integrations, layers, routing
from .torch_ops import gmm, tgmm

implementation_tables = (jax.GMM_TABLE, jax.TGMM_TABLE)

__all__ = [
    "benchmark",
    "expert_parallel",
    "gmm",
    "implementation_tables",
    "integrations",
    "jax",
    "layers",
    "routing",
    "tgmm",
]
