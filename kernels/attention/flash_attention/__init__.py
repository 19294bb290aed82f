"""flash_attention kernel: blocked online-softmax attention (Pallas TPU), Tokamax and XLA.

Exports the torch ops (``dot_product_attention``, ``attention_with_lse``,
``attention_with_dense_mask``), ``jax`` (the JAX API), ``ring`` (context-parallel ring attention)
and ``integrations`` (Transformers' AttentionInterface; imported on first use because it imports
transformers).
"""

import importlib
from typing import Any

from . import api as jax
from . import benchmark, ring
from .torch_ops import attention_with_dense_mask, attention_with_lse, dot_product_attention

implementation_tables = (jax.TABLE,)


def __getattr__(name: str) -> Any:
    if name == "integrations":
        return importlib.import_module(".integrations", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "attention_with_dense_mask",
    "attention_with_lse",
    "benchmark",
    "dot_product_attention",
    "implementation_tables",
    "integrations",
    "jax",
    "ring",
]
