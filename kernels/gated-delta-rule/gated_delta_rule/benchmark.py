"""Representative shapes with FLOPs and bytes per call: Qwen3-Next-80B-A3B's linear-attention
layer (16 q/k heads, 32 value heads, head dims 128) in prefill and decode, and small CPU cases.
``TORCH_IMPLEMENTATIONS`` times Transformers' own torch fallbacks beside the op."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernel_hub.kernel_api import CPU_TAG, KernelCase, MeshCase

from . import api
from .api import chunk_gated_delta_rule, recurrent_gated_delta_rule

chunk_op = api.chunk_gated_delta_rule.torch

CHUNK = 64


def _structs(batch, tokens, key_heads, heads, key_dim, value_dim, dtype):
    qk = jax.ShapeDtypeStruct((batch, tokens, key_heads, key_dim), dtype)
    return (
        qk,
        qk,
        jax.ShapeDtypeStruct((batch, tokens, heads, value_dim), dtype),
        jax.ShapeDtypeStruct((batch, tokens, heads), jnp.float32),
        jax.ShapeDtypeStruct((batch, tokens, heads), jnp.float32),
        jax.ShapeDtypeStruct((batch, heads, key_dim, value_dim), jnp.float32),
    )


def prefill_case(
    name, batch, tokens, key_heads, heads, key_dim, value_dim, dtype=jnp.bfloat16, tags=()
):
    itemsize = jnp.dtype(dtype).itemsize
    rows = batch * heads * tokens
    state = batch * heads * key_dim * value_dim * 4
    return KernelCase(
        name=name,
        fn=chunk_gated_delta_rule,
        args=_structs(batch, tokens, key_heads, heads, key_dim, value_dim, dtype),
        kwargs={"use_qk_l2norm": True},
        # per token: k k^T, q k^T and attn v rows of the chunk (C * (2K + V) MACs), the
        # triangular solve (C * (V + K) / 2 MACs), W S, q S and k^T v_new (3 K V MACs)
        flops=2 * rows * (CHUNK * (2 * key_dim + value_dim) + CHUNK * (value_dim + key_dim) // 2)
        + 2 * rows * 3 * key_dim * value_dim,
        bytes_accessed=2 * batch * tokens * key_heads * key_dim * itemsize
        + 2 * batch * tokens * heads * value_dim * itemsize
        + 2 * batch * tokens * heads * 4
        + 2 * state,
        differentiable=(0, 1, 2, 3, 4),
        tags=tuple(tags),
    )


def decode_case(name, batch, key_heads, heads, key_dim, value_dim, dtype=jnp.bfloat16, tags=()):
    itemsize = jnp.dtype(dtype).itemsize
    state = batch * heads * key_dim * value_dim * 4
    return KernelCase(
        name=name,
        fn=recurrent_gated_delta_rule,
        args=_structs(batch, 1, key_heads, heads, key_dim, value_dim, dtype),
        kwargs={"use_qk_l2norm": True},
        # decay, read, update and output: 4 multiply-adds per state entry
        flops=8 * batch * heads * key_dim * value_dim,
        # the state is read and written once; the token's q, k, v, o are small
        bytes_accessed=2 * state
        + 2 * batch * key_heads * key_dim * itemsize
        + 2 * batch * heads * value_dim * itemsize,
        differentiable=(),
        tags=tuple(tags),
    )


CASES = [
    prefill_case("qwen3-next-prefill-8k", 1, 8192, 16, 32, 128, 128),
    prefill_case("qwen3-next-prefill-b4-2k", 4, 2048, 16, 32, 128, 128),
    decode_case("qwen3-next-decode-b64", 64, 16, 32, 128, 128),
    prefill_case("cpu-prefill-200", 1, 200, 2, 4, 128, 128, tags=(CPU_TAG,)),
    prefill_case("cpu-prefill-200-f32", 1, 200, 2, 4, 128, 128, jnp.float32, tags=(CPU_TAG,)),
    decode_case("cpu-decode-b8", 8, 2, 4, 128, 128, tags=(CPU_TAG,)),
]


def transformers_chunk(q, k, v, g, beta, initial_state, use_qk_l2norm):
    """Transformers' torch fallback (qwen3_next ``torch_chunk_gated_delta_rule``)."""
    from transformers.models.qwen3_next import modeling_qwen3_next as m

    return m.torch_chunk_gated_delta_rule(
        q,
        k,
        v,
        g,
        beta,
        initial_state=initial_state,
        output_final_state=True,
        use_qk_l2norm_in_kernel=use_qk_l2norm,
    )


def kernel_hub_chunk(q, k, v, g, beta, initial_state, use_qk_l2norm):
    """kernel-hub's chunk_gated_delta_rule torch op (platform's default implementation)."""
    return chunk_op(q, k, v, g, beta, initial_state, use_qk_l2norm=use_qk_l2norm)


TORCH_IMPLEMENTATIONS = {"transformers": transformers_chunk, "torch-op": kernel_hub_chunk}


def mesh_cases() -> list[MeshCase]:
    """Qwen3-Next's heads on 2-way tensor parallel (8 q/k, 16 v, dims 128) with heads over model
    and batch over data: no collectives, forward or backward; prefill and a 2-token decode step
    (whose backward is XLA's; the chunked form's is a Pallas kernel)."""

    def shapes(length):
        qk = jax.ShapeDtypeStruct((2, length, 8, 128), jnp.bfloat16)
        v = jax.ShapeDtypeStruct((2, length, 16, 128), jnp.bfloat16)
        gate = jax.ShapeDtypeStruct((2, length, 16), jnp.float32)
        return (qk, qk, v, gate, gate)

    token = ("data", None, "model", None)
    specs = (token, token, token, ("data", None, "model"), ("data", None, "model"))
    state = jax.ShapeDtypeStruct((2, 16, 128, 128), jnp.float32)
    return [
        MeshCase(
            "chunked GVA 8/16 batch x heads bf16",
            lambda q, k, v, g, b: api.chunk_gated_delta_rule(q, k, v, g, b, use_qk_l2norm=True)[0],
            shapes(256),
            specs,
            ("data", "model"),
            differentiable=(0, 1, 2, 3, 4),
        ),
        MeshCase(
            "decode 2 tokens GVA 8/16 batch x heads, f32 state",
            lambda q, k, v, g, b, s: api.recurrent_gated_delta_rule(
                q, k, v, g, b, s, use_qk_l2norm=True
            ),
            (*shapes(2), state),
            (*specs, ("data", "model", None, None)),
            ("data", "model"),
            differentiable=(0, 1, 2, 3, 4, 5),
            xla_backward=True,
        ),
    ]
