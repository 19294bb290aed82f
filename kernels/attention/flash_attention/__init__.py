"""flash_attention kernel: blocked online-softmax attention (Pallas TPU), Tokamax and XLA.

Exports the torch ops (``dot_product_attention``, ``attention_with_lse``,
``attention_with_dense_mask``), ``jax`` (the JAX API), ``ring`` (context-parallel ring attention)
and ``integrations`` / ``transformers_masks`` (Transformers' AttentionInterface and
AttentionMaskInterface entries; imported on first use because they import transformers).
"""

import importlib
from typing import Any

from . import api as jax
from . import benchmark, ring
from .torch_ops import attention_with_dense_mask, attention_with_lse, dot_product_attention

implementation_tables = (jax.TABLE,)


def __getattr__(name: str) -> Any:
    if name in ("integrations", "transformers_masks"):
        return importlib.import_module(f".{name}", __name__)
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
    "transformers_masks",
]
