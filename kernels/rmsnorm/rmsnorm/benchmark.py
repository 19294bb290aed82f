"""Representative shapes with FLOPs and bytes per call (bench and TPU compile checks)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernel_hub.cases import KernelCase

from .api import rms_norm

# (name, tokens, hidden): decode batch, prefill chunks of Llama-3-8B/70B-sized models.
SHAPES = (
    ("decode-b8-h4096", 8, 4096),
    ("prefill-8k-h4096", 8192, 4096),
    ("prefill-8k-h8192", 8192, 8192),
    ("ragged-1000-h5120", 1000, 5120),
    ("odd-hidden-4096-h1000", 4096, 1000),
)


def case(name: str, tokens: int, hidden: int, dtype=jnp.bfloat16) -> KernelCase:
    itemsize = jnp.dtype(dtype).itemsize
    return KernelCase(
        name=name,
        fn=rms_norm,
        args=(
            jax.ShapeDtypeStruct((tokens, hidden), dtype),
            jax.ShapeDtypeStruct((hidden,), dtype),
        ),
        kwargs={"eps": 1e-6},
        # square, mean, rsqrt-scale, weight-scale per element
        flops=4 * tokens * hidden,
        # read x, write y, read weight
        bytes_accessed=2 * tokens * hidden * itemsize + hidden * itemsize,
        differentiable=(0, 1),
    )


CASES = [case(*shape) for shape in SHAPES]
