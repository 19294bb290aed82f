"""Representative shapes with FLOPs and bytes per call (bench and TPU compile checks).

Llama-3-8B-like attention: 32 query heads, 8 kv heads, head_dim 128, bf16; causal FLOPs count
only the visible (query, key) pairs, about half of the square.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernel_hub.cases import KernelCase

from . import masking
from .api import dot_product_attention, make_spec

# (name, batch, q_heads, kv_heads, q_len, kv_len, head_dim, static options)
SHAPES = (
    ("prefill-2k-gqa", 1, 32, 8, 2048, 2048, 128, {"causal": True}),
    ("prefill-8k-gqa", 1, 32, 8, 8192, 8192, 128, {"causal": True}),
    ("decode-q1-kv32k-gqa", 8, 32, 8, 1, 32768, 128, {"causal": True}),
    (
        "prefill-4k-window-d256-softcap",
        1,
        16,
        8,
        4096,
        4096,
        256,
        {"causal": True, "sliding_window": 1024, "softcap": 50.0},
    ),
)


def case(name, batch, q_heads, kv_heads, q_len, kv_len, head_dim, options, dtype=jnp.bfloat16):
    itemsize = jnp.dtype(dtype).itemsize
    spec = make_spec(
        head_dim,
        options.get("causal", False),
        options.get("sliding_window"),
        options.get("softcap"),
        None,
    )
    pairs = batch * q_heads * masking.allowed_pairs(q_len, kv_len, spec)
    q_elems = batch * q_heads * q_len * head_dim
    kv_elems = batch * kv_heads * kv_len * head_dim
    return KernelCase(
        name=name,
        fn=dot_product_attention,
        args=(
            jax.ShapeDtypeStruct((batch, q_heads, q_len, head_dim), dtype),
            jax.ShapeDtypeStruct((batch, kv_heads, kv_len, head_dim), dtype),
            jax.ShapeDtypeStruct((batch, kv_heads, kv_len, head_dim), dtype),
        ),
        kwargs=dict(options),
        # q @ k^T and p @ v over the visible pairs
        flops=4 * pairs * head_dim,
        # read q, k, v; write out
        bytes_accessed=(2 * q_elems + 2 * kv_elems) * itemsize,
        differentiable=(0, 1, 2),
        tags=("decode",) if q_len == 1 else ("prefill",),
    )


CASES = [case(*shape) for shape in SHAPES]
