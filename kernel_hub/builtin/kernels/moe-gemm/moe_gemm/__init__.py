"""moe-gemm kernel: grouped matmuls for mixture-of-experts layers.

Torch ops ``gmm`` / ``tgmm``, their JAX functions in ``jax``, token routing helpers in
``routing``, the Transformers experts integration in ``integrations`` and ``layers.MoEExperts``.
"""

from . import api as jax
from . import benchmark, integrations, layers, routing
from .torch_ops import gmm, tgmm

implementation_tables = (jax.GMM_TABLE, jax.TGMM_TABLE)

__all__ = [
    "benchmark",
    "gmm",
    "implementation_tables",
    "integrations",
    "jax",
    "layers",
    "routing",
    "tgmm",
]
