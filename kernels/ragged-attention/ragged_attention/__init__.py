"""ragged_attention kernel: serving attention (forward only) for many sequences at once.

Exports the torch entry points ``ragged_attention`` (packed varlen batches: chunked prefill mixed
with decode) and ``paged_attention`` (decode over Transformers' paged KV cache, read in place),
their raw ops, ``jax`` (the JAX API) and ``integrations`` (Transformers continuous batching;
imported on first use because it imports transformers).
"""

import importlib
from typing import Any

from . import api as jax
from . import benchmark
from .torch_ops import (
    paged_attention,
    paged_attention_op,
    ragged_attention,
    ragged_attention_op,
)

implementation_tables = (jax.RAGGED_TABLE, jax.PAGED_TABLE)


def __getattr__(name: str) -> Any:
    if name == "integrations":
        return importlib.import_module(".integrations", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "benchmark",
    "implementation_tables",
    "integrations",
    "jax",
    "paged_attention",
    "paged_attention_op",
    "ragged_attention",
    "ragged_attention_op",
]
