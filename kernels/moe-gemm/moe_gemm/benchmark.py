"""Representative gmm calls with FLOPs and bytes per call (bench and TPU compile checks).

Each MoE layer does two grouped matmuls on Transformers' weight layout (``transpose_rhs``):
gate/up ([m, H] x [E, 2I, H]) and down ([m, I] x [E, H, I]), with m = tokens * top_k rows.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from kernel_hub.cases import KernelCase

from .api import gmm


class MoEShape(NamedTuple):
    name: str
    experts: int
    hidden: int
    intermediate: int
    top_k: int


MODELS = (
    MoEShape("mixtral-8x7b", experts=8, hidden=4096, intermediate=14336, top_k=2),
    # Fine-grained experts, DeepSeekMoE-16B sized.
    MoEShape("fine-grained-e64", experts=64, hidden=2048, intermediate=1408, top_k=6),
)
# (phase, tokens): decode batches and one prefill chunk.
TOKENS = (("decode", 1), ("decode", 16), ("decode", 256), ("prefill", 8192))


def case(model: MoEShape, projection: str, phase: str, tokens: int, dtype=jnp.bfloat16):
    """One gmm of ``model``'s ``projection`` ("gate_up" or "down") for ``tokens`` tokens."""
    rows = tokens * model.top_k
    k, n = (
        (model.hidden, 2 * model.intermediate)
        if projection == "gate_up"
        else (model.intermediate, model.hidden)
    )
    itemsize = jnp.dtype(dtype).itemsize
    # Only experts that receive rows have their weights read: at most min(E, rows) of them.
    experts_read = min(model.experts, rows)
    return KernelCase(
        name=f"{model.name}-{projection}-{phase}{tokens}",
        fn=gmm,
        args=(
            jax.ShapeDtypeStruct((rows, k), dtype),
            jax.ShapeDtypeStruct((model.experts, n, k), dtype),
            jax.ShapeDtypeStruct((model.experts,), jnp.int32),
        ),
        kwargs={"transpose_rhs": True},
        flops=2 * rows * k * n,
        bytes_accessed=(rows * k + experts_read * k * n + rows * n) * itemsize,
        differentiable=(0, 1),
        tags=(phase, model.name),
    )


CASES = [
    case(model, projection, phase, tokens)
    for model in MODELS
    for projection in ("gate_up", "down")
    for phase, tokens in TOKENS
]
