"""Decode shapes for benchmarks and TPU compile checks: ragged and paged attention.

Llama-3-8B and Mixtral-8x7B share their attention geometry (32 query heads, 8 kv heads,
head_dim 128), so one set of decode cases covers both: ``batch`` sequences each decoding one
token over ``context`` cached keys, bf16. The ragged form reads packed, gathered keys (what
Transformers' index path hands over); the paged form reads the paged cache (page size 256,
Transformers' default) through the block table. Small f32 cases tagged ``cpu`` run in interpret
mode.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from kernel_hub.kernel_api import CPU_TAG, KernelCase, MeshCase

from . import api
from .api import paged_attention, ragged_attention

Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
PAGE_SIZE = 256
BATCHES = (64, 256)
CONTEXTS = (2048, 32768)


def _tokens(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def _draw(rng, shape, kind):
    """Standard normal values drawn in f32, cast to ``kind``."""
    return rng.standard_normal(shape, dtype=np.float32).astype(kind)


def _with_kv_scales(rng, args, scale_shape):
    """``args`` followed by no sinks and the 8-bit cache's positive f32 key and value scales."""
    scales = [np.abs(_draw(rng, scale_shape, np.float32)) / 64 for _ in range(2)]
    return (*args, None, *scales)


def _struct(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def _cost(
    batch: int,
    context: int,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    itemsize: int,
    kv_itemsize: int | None = None,
    scale_bytes: int = 0,
):
    """FLOPs and bytes of one decode step: K and V (``kv_itemsize`` bytes an element, plus
    ``scale_bytes`` per token and kv head for an 8-bit cache) read once, q read and the output
    written once."""
    kv_itemsize = itemsize if kv_itemsize is None else kv_itemsize
    flops = 4 * batch * context * q_heads * head_dim
    kv_bytes = 2 * batch * context * kv_heads * (head_dim * kv_itemsize + scale_bytes)
    return flops, kv_bytes + 2 * batch * q_heads * head_dim * itemsize


def ragged_decode_case(
    batch,
    context,
    q_heads=Q_HEADS,
    kv_heads=KV_HEADS,
    head_dim=HEAD_DIM,
    dtype=jnp.bfloat16,
    tags=(),
    kv_dtype=None,
) -> KernelCase:
    """``kv_dtype`` (float8_e4m3fn, int8): 8-bit keys and values with f32 scales [Hkv, N]."""
    keys = batch * context
    kv_kind = dtype if kv_dtype is None else jnp.dtype(kv_dtype)

    def make_args(rng):
        cu_q = np.arange(batch + 1, dtype=np.int32)
        args = (
            _draw(rng, (batch, q_heads, head_dim), dtype),
            _draw(rng, (keys, kv_heads, head_dim), kv_kind),
            _draw(rng, (keys, kv_heads, head_dim), kv_kind),
            cu_q,
            cu_q * context,
        )
        return args if kv_dtype is None else _with_kv_scales(rng, args, (kv_heads, keys))

    flops, bytes_accessed = _cost(
        batch,
        context,
        q_heads,
        kv_heads,
        head_dim,
        jnp.dtype(dtype).itemsize,
        jnp.dtype(kv_kind).itemsize,
        0 if kv_dtype is None else 4,
    )
    args = (
        _struct((batch, q_heads, head_dim), dtype),
        _struct((keys, kv_heads, head_dim), kv_kind),
        _struct((keys, kv_heads, head_dim), kv_kind),
        _struct((batch + 1,), jnp.int32),
        _struct((batch + 1,), jnp.int32),
    )
    if kv_dtype is not None:
        scales = _struct((kv_heads, keys), jnp.float32)
        args = (*args, None, scales, scales)
    return KernelCase(
        name=f"ragged-decode-b{batch}-ctx{_tokens(context)}"
        + ("" if kv_dtype is None else f"-kv-{jnp.dtype(kv_dtype).name}"),
        fn=ragged_attention,
        args=args,
        kwargs={"causal": True},
        flops=flops,
        bytes_accessed=bytes_accessed,
        tags=("decode", "ragged", *tags),
        make_args=make_args,
    )


def paged_decode_case(
    batch,
    context,
    q_heads=Q_HEADS,
    kv_heads=KV_HEADS,
    head_dim=HEAD_DIM,
    page_size=PAGE_SIZE,
    dtype=jnp.bfloat16,
    tags=(),
    cache_pages=None,
    kv_dtype=None,
) -> KernelCase:
    """``cache_pages`` < batch x pages per sequence: sequences share pages (prefix sharing), so
    a table that large fits one chip's HBM. ``kv_dtype`` (float8_e4m3fn, int8): an 8-bit cache
    with its f32 scales per token and kv head (``kv_quant``)."""
    pages_per_seq = -(-context // page_size)
    num_pages = cache_pages or batch * pages_per_seq + 1
    page_dtype = dtype if kv_dtype is None else jnp.dtype(kv_dtype)
    page_shape = (num_pages, page_size, kv_heads, head_dim)

    def make_args(rng):
        table = rng.integers(0, num_pages, (batch, pages_per_seq))
        lens = np.full(batch, context, np.int32)
        args = (
            _draw(rng, (batch, q_heads, head_dim), dtype),
            _draw(rng, page_shape, page_dtype),
            _draw(rng, page_shape, page_dtype),
            table.astype(np.int32),
            lens,
        )
        scale_shape = (num_pages, kv_heads, page_size)
        return args if kv_dtype is None else _with_kv_scales(rng, args, scale_shape)

    flops, bytes_accessed = _cost(
        batch,
        context,
        q_heads,
        kv_heads,
        head_dim,
        jnp.dtype(dtype).itemsize,
        jnp.dtype(page_dtype).itemsize,
        0 if kv_dtype is None else 4,
    )
    args = (
        _struct((batch, q_heads, head_dim), dtype),
        _struct(page_shape, page_dtype),
        _struct(page_shape, page_dtype),
        _struct((batch, pages_per_seq), jnp.int32),
        _struct((batch,), jnp.int32),
    )
    if kv_dtype is not None:
        scales = _struct((num_pages, kv_heads, page_size), jnp.float32)
        args = (*args, None, scales, scales)
    return KernelCase(
        name=f"paged-decode-b{batch}-ctx{_tokens(context)}-page{page_size}"
        + ("-shared-cache" if cache_pages else "")
        + ("" if kv_dtype is None else f"-kv-{jnp.dtype(kv_dtype).name}"),
        fn=paged_attention,
        args=args,
        flops=flops,
        bytes_accessed=bytes_accessed,
        tags=("decode", "paged", *tags),
        make_args=make_args,
    )


# Every decode shape of the serving benchmark (benchmarks/serving.py). 256 x 32k keys of their
# own are 32 GiB of K and V per layer, more than a v5e's or v6e's HBM: those two cases fail to
# compile for that reason, and the shared-page cache case shows the kernel itself at that size.
SERVING_CASES = [
    make(batch, context)
    for make in (ragged_decode_case, paged_decode_case)
    for batch in BATCHES
    for context in CONTEXTS
] + [paged_decode_case(256, 32768, cache_pages=8192)]
# The 8-bit cache: paged decode at the bytes-goal shape (batch 64, 32k context), fp8 and int8
# pages, and the ragged kernel over an 8-bit history read back (Transformers' index path).
KV8_CASES = [paged_decode_case(64, 32768, kv_dtype=kind) for kind in ("float8_e4m3fn", "int8")] + [
    ragged_decode_case(64, 2048, kv_dtype="float8_e4m3fn")
]


def _named(case: KernelCase, suffix: str) -> KernelCase:
    return dataclasses.replace(case, name=f"{case.name}-{suffix}")


# Head dim 256 (Gemma 2/3) beside the serving cases' 128: both kernels take a head as a slice of
# a [tokens, Hkv, D] block, and how Mosaic lowers that slice depends on D (a strided per-head load
# that compiled at 128 failed at 256).
HEAD_DIM_256_CASES = [
    _named(make(16, 2048, 16, 8, 256), "d256") for make in (ragged_decode_case, paged_decode_case)
]

# The registry's compile matrix (every generation, in CI): shapes that fit one chip, and CPU
# cases for kernel-hub bench.
CASES = (
    [
        case
        for case in SERVING_CASES
        if case.name
        in (
            "ragged-decode-b64-ctx2k",
            "paged-decode-b64-ctx32k-page256",
            "paged-decode-b256-ctx32k-page256-shared-cache",
        )
    ]
    + KV8_CASES
    + HEAD_DIM_256_CASES
    + [
        ragged_decode_case(8, 64, 4, 2, 16, dtype=jnp.float32, tags=(CPU_TAG,)),
        paged_decode_case(8, 64, 4, 2, 16, page_size=16, dtype=jnp.float32, tags=(CPU_TAG,)),
    ]
)


def mesh_cases() -> list[MeshCase]:
    """GQA 32/8 heads over model, ragged prefill and paged decode (no collectives needed)."""
    tokens, keys, seqs, pages, page = 1024, 1024, 8, 64, 16
    heads = ("model",)
    return [
        MeshCase(
            "ragged GQA 32/8 heads over model bf16",
            functools.partial(api.ragged_attention, causal=True),
            (
                jax.ShapeDtypeStruct((tokens, 32, 128), jnp.bfloat16),
                jax.ShapeDtypeStruct((keys, 8, 128), jnp.bfloat16),
                jax.ShapeDtypeStruct((keys, 8, 128), jnp.bfloat16),
                jax.ShapeDtypeStruct((seqs + 1,), jnp.int32),
                jax.ShapeDtypeStruct((seqs + 1,), jnp.int32),
            ),
            ((None, *heads, None), (None, *heads, None), (None, *heads, None), (None,), (None,)),
            heads,
        ),
        MeshCase(
            "paged decode GQA 32/8 heads over model bf16",
            api.paged_attention,
            (
                jax.ShapeDtypeStruct((seqs, 32, 128), jnp.bfloat16),
                jax.ShapeDtypeStruct((pages, page, 8, 128), jnp.bfloat16),
                jax.ShapeDtypeStruct((pages, page, 8, 128), jnp.bfloat16),
                jax.ShapeDtypeStruct((seqs, pages // seqs), jnp.int32),
                jax.ShapeDtypeStruct((seqs,), jnp.int32),
            ),
            (
                (None, *heads, None),
                (None, None, *heads, None),
                (None, None, *heads, None),
                (None, None),
                (None,),
            ),
            heads,
        ),
    ]
