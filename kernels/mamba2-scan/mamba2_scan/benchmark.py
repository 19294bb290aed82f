"""Representative shapes with FLOPs and bytes per call: Mamba-2 2.7B's layer (80 heads of 64,
one group, state 128, chunk 256) and Nemotron-H-8B's (128 heads of 64, 8 groups, state 128) in an
8k prefill and a batch-64 decode step, and small CPU cases. ``TORCH_IMPLEMENTATIONS`` times
Transformers' own torch fallback beside the op."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernel_hub.kernel_api import CPU_TAG, KernelCase

from .api import mamba_chunk_scan_combined, selective_state_update
from .torch_ops import mamba_chunk_scan_combined as chunk_op


def prefill_case(
    name, batch, tokens, heads, head_dim, groups, state, chunk=256, dtype=jnp.bfloat16, tags=()
):
    itemsize = jnp.dtype(dtype).itemsize
    rows = batch * heads * tokens
    return KernelCase(
        name=name,
        fn=mamba_chunk_scan_combined,
        args=(
            jax.ShapeDtypeStruct((batch, tokens, heads, head_dim), dtype),
            jax.ShapeDtypeStruct((batch, tokens, heads), dtype),
            jax.ShapeDtypeStruct((heads,), jnp.float32),
            jax.ShapeDtypeStruct((batch, tokens, groups, state), dtype),
            jax.ShapeDtypeStruct((batch, tokens, groups, state), dtype),
            jax.ShapeDtypeStruct((heads,), jnp.float32),
            jax.ShapeDtypeStruct((heads,), jnp.float32),
        ),
        kwargs={"chunk_size": chunk, "dt_softplus": True},
        # per token and head: C B^T and scores x over its chunk (chunk * (N + P) MACs), the
        # entering state read through C and the chunk state update (2 P N MACs)
        flops=2 * rows * (chunk * (state + head_dim) + 2 * head_dim * state),
        # x and dt in, y out in f32, B and C once per group, the final state out in f32
        bytes_accessed=batch * tokens * heads * head_dim * (itemsize + 4)
        + batch * tokens * heads * itemsize
        + 2 * batch * tokens * groups * state * itemsize
        + batch * heads * head_dim * state * 4,
        differentiable=(0, 1, 2, 3, 4),
        tags=tuple(tags),
    )


def decode_case(name, batch, heads, head_dim, groups, state, dtype=jnp.bfloat16, tags=()):
    itemsize = jnp.dtype(dtype).itemsize
    entries = batch * heads * head_dim * state
    return KernelCase(
        name=name,
        fn=selective_state_update,
        args=(
            jax.ShapeDtypeStruct((batch, heads, head_dim, state), jnp.float32),
            jax.ShapeDtypeStruct((batch, heads, head_dim), dtype),
            jax.ShapeDtypeStruct((batch, heads), dtype),
            jax.ShapeDtypeStruct((heads,), jnp.float32),
            jax.ShapeDtypeStruct((batch, groups, state), dtype),
            jax.ShapeDtypeStruct((batch, groups, state), dtype),
            jax.ShapeDtypeStruct((heads,), jnp.float32),
            None,
            jax.ShapeDtypeStruct((heads,), jnp.float32),
        ),
        kwargs={"dt_softplus": True},
        # decay, dt B x, update and the C read-out: 3 multiply-adds per state entry
        flops=6 * entries,
        # the f32 state read and written once, A per channel once per call
        bytes_accessed=2 * entries * 4
        + heads * head_dim * state * 4
        + 2 * batch * heads * head_dim * itemsize,
        differentiable=(),
        tags=tuple(tags),
    )


CASES = [
    prefill_case("mamba2-2.7b-prefill-8k", 1, 8192, 80, 64, 1, 128),
    prefill_case("nemotron-h-8b-prefill-8k", 1, 8192, 128, 64, 8, 128, chunk=128),
    decode_case("mamba2-2.7b-decode-b64", 64, 80, 64, 1, 128),
    prefill_case("cpu-prefill-300", 1, 300, 8, 64, 2, 128, chunk=128, tags=(CPU_TAG,)),
    prefill_case(
        "cpu-prefill-300-f32", 1, 300, 8, 64, 2, 128, chunk=128, dtype=jnp.float32, tags=(CPU_TAG,)
    ),
    decode_case("cpu-decode-b8", 8, 16, 64, 2, 128, tags=(CPU_TAG,)),
]


def transformers_chunk(x, dt, A, B, C, D, dt_bias, chunk_size, dt_softplus):
    """Transformers' torch fallback (mamba2 ``mamba2_chunk_scan``)."""
    from transformers.models.mamba2 import modeling_mamba2 as m

    return m.mamba2_chunk_scan(
        x, dt, A, B, C, chunk_size, D=D, dt_bias=dt_bias, dt_softplus=dt_softplus
    )


def kernel_hub_chunk(x, dt, A, B, C, D, dt_bias, chunk_size, dt_softplus):
    """kernel-hub's mamba_chunk_scan_combined torch op (platform's default implementation)."""
    return chunk_op(x, dt, A, B, C, D, dt_bias, chunk_size=chunk_size, dt_softplus=dt_softplus)[0]


TORCH_IMPLEMENTATIONS = {"transformers": transformers_chunk, "torch-op": kernel_hub_chunk}
