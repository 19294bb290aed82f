"""Representative shapes with FLOPs and bytes per call: Mamba-2 2.7B's layer (80 heads of 64,
one group, state 128, chunk 256) in an 8k prefill and a batch-64 decode step, and small CPU
cases. ``TORCH_IMPLEMENTATIONS`` times
Transformers' own torch fallback beside the op."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernel_hub.kernel_api import CPU_TAG, KernelCase, MeshCase

from . import api
from .api import mamba_chunk_scan_combined, selective_state_update

chunk_op = api.mamba_chunk_scan_combined.torch
decode_op = api.selective_state_update.torch


def prefill_case(
    name,
    batch,
    tokens,
    heads,
    head_dim,
    groups,
    state,
    chunk=256,
    dtype=jnp.bfloat16,
    tags=(),
    differentiable=(0, 1, 2, 3, 4),
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
        differentiable=differentiable,
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
            # per channel, as Transformers' mixers pass dt, A, D and dt_bias
            jax.ShapeDtypeStruct((batch, heads, head_dim), dtype),
            jax.ShapeDtypeStruct((heads, head_dim, state), jnp.float32),
            jax.ShapeDtypeStruct((batch, groups, state), dtype),
            jax.ShapeDtypeStruct((batch, groups, state), dtype),
            jax.ShapeDtypeStruct((heads, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((batch, heads, head_dim), dtype),  # z: Falcon-H1's decode gate
            jax.ShapeDtypeStruct((heads, head_dim), jnp.float32),
        ),
        kwargs={"dt_softplus": True},
        # decay, dt B x, update and the C read-out: 3 multiply-adds per state entry
        flops=6 * entries,
        # the f32 state read and written once, A per channel once per call, x, z and y
        bytes_accessed=2 * entries * 4
        + heads * head_dim * state * 4
        + 3 * batch * heads * head_dim * itemsize,
        differentiable=(),
        tags=tuple(tags),
    )


# The compile matrix compiles every case for four generations and both implementations, and the
# XLA chunked form compiles slowly (the 8k backward ~90 s a cell, deviceless on a loaded host):
# the model-size cases are forward only; the backward is compiled at the small f32 case.
CASES = [
    prefill_case("mamba2-2.7b-prefill-8k", 1, 8192, 80, 64, 1, 128, differentiable=()),
    decode_case("mamba2-2.7b-decode-b64", 64, 80, 64, 1, 128),
    prefill_case(
        "cpu-prefill-300-f32", 1, 300, 8, 64, 2, 128, chunk=128, dtype=jnp.float32, tags=(CPU_TAG,)
    ),
    decode_case("cpu-decode-b8", 8, 16, 64, 2, 128, tags=(CPU_TAG,)),
]


def transformers_fallback(*args, dt_softplus, chunk_size=None):
    """Transformers' torch fallbacks (mamba2 ``mamba2_chunk_scan``, or for a decode case
    ``mamba2_selective_state_update``)."""
    from transformers.models.mamba2 import modeling_mamba2 as m

    if chunk_size is not None:
        x, dt, A, B, C, D, dt_bias = args
        return m.mamba2_chunk_scan(
            x, dt, A, B, C, chunk_size, D=D, dt_bias=dt_bias, dt_softplus=dt_softplus
        )
    state, x, dt, A, B, C, D, z, dt_bias = args
    return m.mamba2_selective_state_update(
        state, x, dt, A, B, C, D, dt_bias=dt_bias, dt_softplus=dt_softplus, z=z
    )


def kernel_hub_ops(*args, dt_softplus, chunk_size=None):
    """kernel-hub's torch ops (platform's default implementation)."""
    if chunk_size is not None:
        return chunk_op(*args, chunk_size=chunk_size, dt_softplus=dt_softplus)[0]
    return decode_op(*args, dt_softplus=dt_softplus)[0]


TORCH_IMPLEMENTATIONS = {"transformers": transformers_fallback, "torch-op": kernel_hub_ops}


def mesh_cases() -> list[MeshCase]:
    """Nemotron-H-like heads (64 heads of 64, 8 groups, state 128) with heads over model and batch
    over data: no collectives in the forward; the backward (XLA's) sums A's gradient over the
    batch shards. The decode step is forward only (its Pallas kernel aliases the state, and
    Pallas has no JVP for aliased calls)."""

    def struct(shape, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype)

    x, dt, bc = struct((2, 512, 64, 64)), struct((2, 512, 64)), struct((2, 512, 8, 128))
    token = ("data", None, "model", None)
    step = ("data", "model", None)
    per_head = ("model", None)
    decode_specs = (("data", "model", None, None), step, step, ("model", None, None), step, step)
    return [
        MeshCase(
            "chunk scan 64 heads / 8 groups, batch x heads bf16",
            lambda x, dt, a, b, c: api.mamba_chunk_scan_combined(
                x, dt, a, b, c, chunk_size=128, dt_softplus=True
            )[0],
            (x, dt, struct((64,), jnp.float32), bc, bc),
            (token, ("data", None, "model"), ("model",), token, token),
            ("data", "model"),
            differentiable=(0, 1, 2, 3, 4),
            backward_collectives={"all-reduce": 1},
            xla_backward=True,
        ),
        MeshCase(
            "decode step 64 heads / 8 groups, batch x heads, f32 state",
            lambda state, x, dt, a, b, c, d, z, bias: api.selective_state_update(
                state, x, dt, a, b, c, d, z, bias, dt_softplus=True
            ),
            (
                struct((8, 64, 64, 128), jnp.float32),
                struct((8, 64, 64)),
                struct((8, 64, 64)),
                struct((64, 64, 128), jnp.float32),
                struct((8, 8, 128)),
                struct((8, 8, 128)),
                struct((64, 64), jnp.float32),
                struct((8, 64, 64)),
                struct((64, 64), jnp.float32),
            ),
            (*decode_specs, per_head, step, per_head),
            ("data", "model"),
        ),
    ]
