"""Representative shapes with FLOPs and bytes per call (bench and TPU compile checks), and the
torch paths ``kernel-hub bench`` times beside the JAX implementations.

Llama-3-8B-like attention: 32 query heads, 8 kv heads, head_dim 128; causal FLOPs count only the
visible (query, key) pairs, about half of the square. Besides plain prefill and decode, cases
cover what Transformers sends with padded batches (key padding) and packed sequences (segments).
One case is Flux's (24 heads of 128, 4,608 tokens, no mask).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import torch

from kernel_hub.kernel_api import CPU_TAG, KernelCase, MeshCase, NoImplementationError

from . import api, masking, ring
from .api import dot_product_attention_with_lse
from .options import AttentionSpec
from .torch_api import dot_product_attention as dot_product_attention_op

# (name, batch, q_heads, kv_heads, q_len, kv_len, head_dim, options, extra inputs, dtype, tags)
# extra inputs: "kv_mask" adds key padding; "segments" adds key padding and segment ids.
SHAPES = (
    ("prefill-2k-gqa", 1, 32, 8, 2048, 2048, 128, {"causal": True}, "", "bfloat16", ()),
    ("prefill-8k-gqa", 1, 32, 8, 8192, 8192, 128, {"causal": True}, "", "bfloat16", ()),
    ("decode-q1-kv32k-gqa", 8, 32, 8, 1, 32768, 128, {"causal": True}, "", "bfloat16", ()),
    (
        "prefill-4k-window-d256-softcap",
        1,
        16,
        8,
        4096,
        4096,
        256,
        {"causal": True, "sliding_window": 1024, "softcap": 50.0},
        "",
        "bfloat16",
        (),
    ),
    (
        "decode-q16-kv32k-key-padding",
        8,
        32,
        8,
        16,
        32768,
        128,
        {"causal": True},
        "kv_mask",
        "bfloat16",
        (),
    ),
    (
        "prefill-2k-packed-window512",
        1,
        32,
        8,
        2048,
        2048,
        128,
        {"causal": True, "sliding_window": 512},
        "segments",
        "bfloat16",
        (),
    ),
    # Flux's joint attention at 1024 x 1024 px (4,096 image + 512 text tokens, every pair
    # visible): the default blocks grown past 512 query rows (pallas_tpu._EVERY_PAIR_FORWARD)
    ("flux-joint-4608", 1, 24, 24, 4608, 4608, 128, {}, "", "bfloat16", ()),
    ("cpu-prefill-512-gqa", 1, 32, 8, 512, 512, 128, {"causal": True}, "", "float32", (CPU_TAG,)),
    (
        "cpu-decode-q1-kv4096-gqa",
        1,
        32,
        8,
        1,
        4096,
        128,
        {"causal": True},
        "",
        "float32",
        (CPU_TAG,),
    ),
)


def _arguments(batch, q_heads, kv_heads, q_len, kv_len, head_dim, extra, dtype):
    struct = jax.ShapeDtypeStruct
    args = [
        struct((batch, q_heads, q_len, head_dim), dtype),
        struct((batch, kv_heads, kv_len, head_dim), dtype),
        struct((batch, kv_heads, kv_len, head_dim), dtype),
    ]
    if extra:
        args.append(struct((batch, kv_len), jnp.bool_))
    if extra == "segments":
        args += [struct((batch, q_len), jnp.int32), struct((batch, kv_len), jnp.int32)]
    return tuple(args)


def _drawer(args):
    """make_args for cases with masks: normal q, k, v; the last eighth of the keys padded; four
    packed sequences of random lengths (queries take the ids of the keys they align with)."""

    def draw(rng: np.random.Generator):
        q, k, v = (rng.standard_normal(a.shape, dtype=np.float32).astype(a.dtype) for a in args[:3])
        batch, kv_len = args[3].shape
        kv_mask = np.broadcast_to(np.arange(kv_len) < kv_len - kv_len // 8, (batch, kv_len))
        values = [q, k, v, kv_mask.copy()]
        if len(args) > 4:
            kv_ids = np.sort(rng.integers(0, 4, (batch, kv_len)), axis=1).astype(np.int32)
            values += [kv_ids[:, kv_len - args[4].shape[1] :].copy(), kv_ids]
        return tuple(values)

    return draw


def case(name, batch, q_heads, kv_heads, q_len, kv_len, head_dim, options, extra, dtype, tags):
    dtype = jnp.dtype(dtype)
    spec = AttentionSpec(**options)
    pairs = batch * q_heads * masking.allowed_pairs(q_len, kv_len, spec)
    q_elems = batch * q_heads * q_len * head_dim
    kv_elems = batch * kv_heads * kv_len * head_dim
    args = _arguments(batch, q_heads, kv_heads, q_len, kv_len, head_dim, extra, dtype)
    return KernelCase(
        name=name,
        fn=dot_product_attention_with_lse,
        args=args,
        kwargs=dict(options),
        # q @ k^T and p @ v over the visible pairs
        flops=4 * pairs * head_dim,
        # read q, k, v; write out
        bytes_accessed=(2 * q_elems + 2 * kv_elems) * dtype.itemsize,
        differentiable=(0, 1, 2),
        tags=tuple(tags),
        make_args=_drawer(args) if extra else None,
    )


def production_case(name, q_heads, kv_heads, seq, head_dim, value_dim, options, sinks):
    """Prefill at a production model's head layout, with attention sinks and/or a value head dim
    of its own: GPT-OSS-20B (64 q / 8 kv heads of 64, sinks, 128-token window on alternate
    layers), DeepSeek-V3 (MLA: 128 heads, q/k 192 = 128 nope + 64 rope, v 128)."""
    dtype = jnp.dtype("bfloat16")
    struct = jax.ShapeDtypeStruct
    args = (
        struct((1, q_heads, seq, head_dim), dtype),
        struct((1, kv_heads, seq, head_dim), dtype),
        struct((1, kv_heads, seq, value_dim), dtype),
        None,  # kv_mask
        None,  # q_segment_ids
        None,  # kv_segment_ids
        struct((q_heads,), dtype) if sinks else None,
    )
    spec = AttentionSpec(causal=True, **options)
    pairs = q_heads * masking.allowed_pairs(seq, seq, spec)

    def draw(rng: np.random.Generator):
        return tuple(
            None if a is None else rng.standard_normal(a.shape, dtype=np.float32).astype(a.dtype)
            for a in args
        )

    return KernelCase(
        name=name,
        fn=dot_product_attention_with_lse,
        args=args,
        kwargs={"causal": True, **options},
        flops=2 * pairs * (head_dim + value_dim),
        bytes_accessed=(
            q_heads * seq * (head_dim + value_dim) + kv_heads * seq * (head_dim + value_dim)
        )
        * dtype.itemsize,
        differentiable=(0, 1, 2, 6) if sinks else (0, 1, 2),
        make_args=draw,
    )


# Compiled for every TPU generation by the tests (deviceless); not in CASES, whose every entry the
# runtime tests also run through torch, with an op argument per case argument.
PRODUCTION_CASES = [
    production_case(
        "gpt-oss-20b-prefill-4k-sinks-window128",
        64,
        8,
        4096,
        64,
        64,
        {"sliding_window": 128},
        sinks=True,
    ),
    production_case("gpt-oss-20b-prefill-4k-sinks", 64, 8, 4096, 64, 64, {}, sinks=True),
    production_case("deepseek-v3-prefill-4k-mla", 128, 128, 4096, 192, 128, {}, sinks=False),
]

CASES = [
    case(*shape) for shape in SHAPES
] + [
    # A decode step with GPT-OSS-20B's heads (64 q / 8 kv of 64) forward only, as a serving
    # step calls it: the kernel reads K and V sequence-minor (``pallas_tpu.SequenceMinor``).
    dataclasses.replace(
        case("decode-q1-kv4k-d64-forward", 8, 64, 8, 1, 4096, 64, {"causal": True}, "",
             "bfloat16", ()),
        fn=api.dot_product_attention,
        differentiable=(),
    ),
]  # fmt: skip

MEMORY_MASKS = ("unpadded", "padded", "image-prefix")
"""Masks of ``mask_memory_case``: none; key padding; Gemma-3-style image groups + key padding."""


def mask_memory_case(mask: str, batch: int, length: int) -> KernelCase:
    """Llama-3-8B heads (32/8, D 128, bf16), causal, under one of ``MEMORY_MASKS`` (abstract
    arguments: what a padded batch and an image-token prefix hand the kernel, O(S) each). Compiled
    deviceless to compare temporary HBM (``benchmarks/attention_mask_memory.py``, tests)."""
    struct = jax.ShapeDtypeStruct
    q = struct((batch, 32, length, 128), jnp.bfloat16)
    kv = struct((batch, 8, length, 128), jnp.bfloat16)
    per_token = {
        "unpadded": (),
        "padded": (struct((batch, length), jnp.bool_),),
        "image-prefix": (
            struct((batch, length), jnp.bool_),  # kv_mask
            *(None,) * 5,  # segment ids, sinks, positions
            struct((batch, length), jnp.int32),  # q_groups
            struct((batch, length), jnp.int32),  # kv_groups
        ),
    }[mask]
    return KernelCase(
        name=f"{mask}-b{batch}-s{length}",
        fn=dot_product_attention_with_lse,
        args=(q, kv, kv, *per_token),
        kwargs={"causal": True},
        differentiable=(0, 1, 2),
    )


def torch_sdpa(query, key, value, *masks, causal=False, sliding_window=None, softcap=None):
    """torch's scaled_dot_product_attention as a torch user calls it for plain causal prefill or
    decode (one query sees every cached key); other cases have no stock SDPA call."""
    q_len, kv_len = query.shape[2], key.shape[2]
    if masks or sliding_window is not None or softcap is not None or 1 < q_len != kv_len:
        raise NoImplementationError("torch SDPA baseline covers plain causal prefill and decode")
    return torch.nn.functional.scaled_dot_product_attention(
        query, key, value, is_causal=causal and q_len > 1, enable_gqa=True
    )


def kernel_hub_attention(query, key, value, *masks, **options):
    """kernel-hub's torch op (DLPack bridge to JAX, platform's default implementation)."""
    return dot_product_attention_op(query, key, value, *masks, **options)


# Torch callables taking a case's arguments as tensors and its kwargs.
TORCH_IMPLEMENTATIONS = {"torch": torch_sdpa, "torch-op": kernel_hub_attention}


def mesh_cases() -> list[MeshCase]:
    """Causal GQA 32/8 with batch over data and heads over model (no collectives needed), and
    causal rings over cp, contiguous, zig-zag and with a sliding window (K/V passed on with
    collective-permute)."""
    long_q = jax.ShapeDtypeStruct((1, 32, 4096, 128), jnp.bfloat16)
    long_kv = jax.ShapeDtypeStruct((1, 8, 4096, 128), jnp.bfloat16)
    cp = (None, None, "cp", None)
    q = jax.ShapeDtypeStruct((2, 32, 1024, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 8, 1024, 128), jnp.bfloat16)
    spec = ("data", "model", None, None)
    return [
        MeshCase(
            "causal GQA 32/8 batch x heads bf16",
            lambda q, k, v: api.dot_product_attention(q, k, v, causal=True),
            (q, kv, kv),
            (spec, spec, spec),
            ("data", "model"),
            differentiable=(0, 1, 2),
        ),
        MeshCase(
            "ring attention causal GQA 32/8 S4096 over cp bf16",
            lambda q, k, v: ring.ring_attention(q, k, v, causal=True),
            (long_q, long_kv, long_kv),
            (cp, cp, cp),
            ("cp",),
            differentiable=(0, 1, 2),
            forward_collectives={"collective-permute": 3},
            backward_collectives={"collective-permute": 3},
            control=False,
        ),
        MeshCase(
            "zig-zag ring attention causal GQA 32/8 S4096 over cp bf16",
            lambda q, k, v: ring.ring_attention(q, k, v, causal=True, layout="zigzag"),
            (long_q, long_kv, long_kv),
            (cp, cp, cp),
            ("cp",),
            differentiable=(0, 1, 2),
            # 4 shards: the local causal block, then 3 steps of 2 equal-work branches.
            forward_collectives={"collective-permute": 3, "mosaic": 7},
            backward_collectives={"collective-permute": 3},
            control=False,
        ),
        MeshCase(
            "sliding-window ring attention causal GQA 32/8 S4096 window 512 over cp bf16",
            lambda q, k, v: ring.ring_attention(q, k, v, causal=True, sliding_window=512),
            (long_q, long_kv, long_kv),
            (cp, cp, cp),
            ("cp",),
            differentiable=(0, 1, 2),
            # 4 shards of 1024: k and v hop once (steps 2, 3 never meet the window).
            forward_collectives={"collective-permute": 2, "mosaic": 2},
            backward_collectives={"collective-permute": 2},
            control=False,
        ),
    ]
