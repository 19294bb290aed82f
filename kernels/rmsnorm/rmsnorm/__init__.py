"""rmsnorm kernel: ``rms_norm`` torch op, ``jax.rms_norm``, ``layers.RMSNorm``."""

from . import api as jax
from . import benchmark, layers
from .torch_ops import rms_norm

implementation_tables = (jax.TABLE,)

__all__ = ["benchmark", "implementation_tables", "jax", "layers", "rms_norm"]
