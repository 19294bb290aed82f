"""The Pallas kernels compile for real TPU generations (deviceless, through libtpu).

Mosaic rejects illegal block shapes and VMEM overflow per generation (v4 has 16 MiB scoped VMEM),
which interpret mode never checks. The registry's compile matrix
(tests/bench/test_compile_matrix.py, ``kernel-hub compile-check attention``) compiles every
benchmark case on every generation, forward and backward; here: the production head layouts, the
dense-mask entry point, every per-token input, and the memory a real batch's mask costs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from kernel_hub.bench.cases import KernelCase
from kernel_hub.bench.compile_check import compile_case

pytest.importorskip("libtpu")
pytestmark = pytest.mark.tpu_compile


def _assert_compiles(kernel: str, case: KernelCase, generation: str) -> None:
    for direction in ("forward", "backward"):
        result = compile_case(kernel, case, generation, direction)
        print(f"{generation} {case.name} {direction}: {result.seconds:.1f} s, {result.memory}")
        assert result.ok, f"{generation} {case.name} {direction}: {result.error}"


@pytest.mark.slow
def test_dense_mask_entry_point_compiles(attention):
    """What Transformers runs with a 4-D mask: the structure check and every lax.switch branch
    (both kernel layouts and the reference fallback) in one program."""

    def struct(*shape, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype)

    case = KernelCase(
        name="prefill-1k-dense-mask",
        fn=attention.dense_mask.attention_with_dense_mask,
        args=(
            struct(1, 32, 1024, 128),
            struct(1, 8, 1024, 128),
            struct(1, 8, 1024, 128),
            struct(1, 1, 1024, 1024, dtype=jnp.bool_),
        ),
        kwargs={"causal": True},
        differentiable=(0, 1, 2),
    )
    _assert_compiles(attention.manifest.name, case, "v5e")


# One production layout per generation, each layout on two generations (the full matrix, every
# layout on every generation, is ``kernel-hub compile-check``-style work recorded in
# docs/attention-features.md; a GPT-OSS compile takes 10-25 s here).
PRODUCTION_PER_GENERATION = {
    "v4": "gpt-oss-20b-prefill-4k-sinks-window128",
    "v5e": "deepseek-v3-prefill-4k-mla",
    "v5p": "deepseek-v3-prefill-4k-mla",
    "v6e": "gpt-oss-20b-prefill-4k-sinks-window128",
}


@pytest.mark.slow
@pytest.mark.parametrize("generation", list(PRODUCTION_PER_GENERATION))
def test_production_head_layouts_compile(attention, generation):
    """GPT-OSS-20B (sinks, window) and DeepSeek-V3 (MLA head dims), forward and backward."""
    name = PRODUCTION_PER_GENERATION[generation]
    case = next(c for c in attention.benchmark.PRODUCTION_CASES if c.name == name)
    _assert_compiles(attention.manifest.name, case, generation)


MASK_BYTES_PER_TOKEN = 256
"""What a real batch's mask may add to the temporaries per (batch row, token): a few int32 per
token and per block (the block-range pre-pass), O(S). A dense [B, 1, S, S] mask is S bytes per
token: 4 KiB at 4k. Since the statistics are stored lane-dense, the unpadded kernel's own
temporaries are near 0, so a bound relative to them alone would allow nothing."""


MASK_MEMORY_BATCH, MASK_MEMORY_LENGTH = 1, 4096


def _mask_memory_temp_bytes(attention, mask: str, direction: str) -> int:
    case = attention.benchmark.mask_memory_case(mask, MASK_MEMORY_BATCH, MASK_MEMORY_LENGTH)
    result = compile_case("attention", case, "v6e", direction)
    assert result.ok, f"{mask} {direction}: {result.error}"
    return result.memory["temp_size"]


@pytest.fixture(scope="module")
def unpadded_temp_bytes(attention):
    """The unpadded kernel's temporaries per direction, compiled once for both masks' tests."""
    return {d: _mask_memory_temp_bytes(attention, "unpadded", d) for d in ("forward", "backward")}


@pytest.mark.slow
@pytest.mark.parametrize("mask", ["padded", "image-prefix"])
def test_real_batch_masks_cost_no_more_than_10_percent_temp_memory(
    attention, unpadded_temp_bytes, mask
):
    """Key padding and image-token groups are O(S) kernel inputs: the compiled program's
    temporary HBM stays within 10% of the unpadded kernel's plus ``MASK_BYTES_PER_TOKEN`` per
    token (v6e, Llama-3-8B heads, 4k; the table at 8k and 32k is in docs/attention-features.md)."""
    allowance = MASK_BYTES_PER_TOKEN * MASK_MEMORY_BATCH * MASK_MEMORY_LENGTH
    for direction, unpadded in unpadded_temp_bytes.items():
        masked = _mask_memory_temp_bytes(attention, mask, direction)
        assert masked <= 1.1 * unpadded + allowance, (direction, masked, unpadded)


@pytest.mark.slow
@pytest.mark.parametrize(
    "q_len, options",
    [(2048, {"sliding_window": 512, "window_bounds_groups": True}), (16, {})],
    ids=["prefill-window-bounds-groups", "decode-whole-groups"],
)
def test_every_per_token_input_compiles(attention, q_len, options):
    """Segment ids, positions and groups together (static-cache prefill / decode of a Gemma-3
    image prompt), forward and backward, on v5e: the in-kernel block-range checks lower."""
    struct = jax.ShapeDtypeStruct
    batch, kv_len = 2, 8192

    def ids(length):
        return struct((batch, length), jnp.int32)

    case = KernelCase(
        name=f"per-token-q{q_len}",
        fn=attention.jax.dot_product_attention_with_lse,
        args=(
            struct((batch, 32, q_len, 128), jnp.bfloat16),
            struct((batch, 8, kv_len, 128), jnp.bfloat16),
            struct((batch, 8, kv_len, 128), jnp.bfloat16),
            struct((batch, kv_len), jnp.bool_),
            ids(q_len),
            ids(kv_len),
            None,  # sinks
            ids(q_len),
            ids(kv_len),
            ids(q_len),
            ids(kv_len),
        ),
        kwargs={"causal": True, **options},
        differentiable=(0, 1, 2),
    )
    _assert_compiles(attention.manifest.name, case, "v5e")


@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_reads_the_cache_in_its_own_layout(attention, head_dim):
    """A decode step's K and V arrive in the layout TPU gives them, sequence-minor where the
    head dim leaves lanes empty (GPT-OSS's 64): the forward-only kernel reads them there, so the
    compiled program holds no copy of them (at version 1.6.2 it copied both into the padded
    head-dim-minor layout, each twice the cache's size), nor at head dim 128 (Llama, Qwen3)."""
    struct = jax.ShapeDtypeStruct
    batch, q_heads, kv_heads, kv_len = 8, 64, 8, 4096
    cache = struct((batch, kv_heads, kv_len, head_dim), jnp.bfloat16)
    case = KernelCase(
        name=f"decode-q1-kv4k-d{head_dim}",
        fn=attention.jax.dot_product_attention,
        args=(struct((batch, q_heads, 1, head_dim), jnp.bfloat16), cache, cache),
        kwargs={"causal": True},
    )
    for generation in ("v5e", "v6e"):
        result = compile_case(attention.manifest.name, case, generation)
        assert result.ok, f"{generation}: {result.error}"
        cache_bytes = cache.size * cache.dtype.itemsize
        assert result.memory["temp_size"] < cache_bytes / 8, (generation, result.memory)
