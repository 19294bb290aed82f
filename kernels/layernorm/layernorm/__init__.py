"""layernorm kernel: ``layer_norm*`` torch ops, ``jax.layer_norm``, ``layers.LayerNorm``."""

from . import api as jax
from . import benchmark, layers
from .torch_ops import layer_norm, layer_norm_any, layer_norm_no_affine, layer_norm_no_bias

implementation_tables = (jax.TABLE,)

__all__ = [
    "benchmark",
    "implementation_tables",
    "jax",
    "layer_norm",
    "layer_norm_any",
    "layer_norm_no_affine",
    "layer_norm_no_bias",
    "layers",
]
