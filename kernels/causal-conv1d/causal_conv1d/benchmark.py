"""Representative shapes with FLOPs and bytes per call: Qwen3-Next-80B-A3B's short convolution
(q, k, v channels 2 * 2048 + 4096 = 8192, width 4) in prefill and decode, and small CPU cases.
``TORCH_IMPLEMENTATIONS`` times Transformers' own torch fallback beside the op."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernel_hub.kernel_api import CPU_TAG, KernelCase, MeshCase

from . import api
from .api import causal_conv1d, causal_conv1d_update

conv_op = api.causal_conv1d.torch

WIDTH = 4


def prefill_case(name, batch, tokens, channels, dtype=jnp.bfloat16, tags=()):
    itemsize = jnp.dtype(dtype).itemsize
    elements = batch * tokens * channels
    return KernelCase(
        name=name,
        fn=causal_conv1d,
        args=(
            jax.ShapeDtypeStruct((batch, tokens, channels), dtype),
            jax.ShapeDtypeStruct((channels, WIDTH), dtype),
        ),
        kwargs={"activation": "silu"},
        # W multiply-adds and the SiLU (~4 flops) per element
        flops=elements * (2 * WIDTH + 4),
        bytes_accessed=2 * elements * itemsize + channels * WIDTH * itemsize,
        differentiable=(0, 1),
        tags=tuple(tags),
    )


def decode_case(name, batch, channels, dtype=jnp.bfloat16, tags=()):
    itemsize = jnp.dtype(dtype).itemsize
    elements = batch * channels
    return KernelCase(
        name=name,
        fn=causal_conv1d_update,
        args=(
            jax.ShapeDtypeStruct((batch, 1, channels), dtype),
            jax.ShapeDtypeStruct((batch, WIDTH, channels), dtype),
            jax.ShapeDtypeStruct((channels, WIDTH), dtype),
        ),
        kwargs={"activation": "silu"},
        flops=elements * (2 * WIDTH + 4),
        # token in and out, the state read and written, the weight
        bytes_accessed=2 * elements * itemsize
        + 2 * batch * WIDTH * channels * itemsize
        + channels * WIDTH * itemsize,
        differentiable=(),
        tags=tuple(tags),
    )


CASES = [
    prefill_case("qwen3-next-prefill-8k", 1, 8192, 8192),
    prefill_case("qwen3-next-prefill-b4-2k", 4, 2048, 8192),
    decode_case("qwen3-next-decode-b64", 64, 8192),
    prefill_case("cpu-prefill-300", 2, 300, 512, tags=(CPU_TAG,)),
    prefill_case("cpu-prefill-300-f32", 2, 300, 512, jnp.float32, tags=(CPU_TAG,)),
    decode_case("cpu-decode-b8", 8, 512, tags=(CPU_TAG,)),
]


def transformers_conv(x, weight, activation):
    """Transformers' torch fallback (qwen3_next ``causal_conv1d_fn``, channels-first)."""
    from transformers.models.qwen3_next import modeling_qwen3_next as m

    return m.causal_conv1d_fn(x.transpose(1, 2), weight, None, activation=activation)


def kernel_hub_conv(x, weight, activation):
    """kernel-hub's causal_conv1d torch op (platform's default implementation)."""
    return conv_op(x, weight, activation=activation)


TORCH_IMPLEMENTATIONS = {"transformers": transformers_conv, "torch-op": kernel_hub_conv}


def mesh_cases() -> list[MeshCase]:
    """Qwen3-Next's conv (8192 channels, width 4) with batch over data and channels over model:
    the weight gradient is summed over the data shards; and its decode step (forward only: the
    Pallas update aliases the state, and Pallas has no JVP for aliased calls)."""
    weight = jax.ShapeDtypeStruct((8192, 4), jnp.bfloat16)
    channels = ("data", None, "model")
    return [
        MeshCase(
            "silu batch x channels bf16",
            lambda x, w: api.causal_conv1d(x, w, activation="silu"),
            (jax.ShapeDtypeStruct((4, 1024, 8192), jnp.bfloat16), weight),
            (channels, ("model", None)),
            ("data", "model"),
            differentiable=(0, 1),
            backward_collectives={"all-reduce": 1},
            xla_backward=True,
        ),
        MeshCase(
            "decode update 1 token, silu batch x channels bf16",
            lambda x, state, w: api.causal_conv1d_update(x, state, w, activation="silu"),
            (
                jax.ShapeDtypeStruct((4, 1, 8192), jnp.bfloat16),
                jax.ShapeDtypeStruct((4, 4, 8192), jnp.bfloat16),
                weight,
            ),
            (channels, channels, ("model", None)),
            ("data", "model"),
        ),
    ]
