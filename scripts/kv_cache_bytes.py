"""Deviceless decode-step bytes of Llama-3-8B (dense): bf16 weights + bf16 KV cache, fp8 weights
(+ bf16 KV), fp8 weights + fp8 KV cache, per TPU generation, batch and context, beside the
hand-count bound (every weight and every cached key and value read once).

    PYTHONPATH=. python scripts/kv_cache_bytes.py [v5e v6e]

Weights: the 32 decoder layers' seven projections (no LM head, no embedding), as
``quantized_matmul_bytes.step_bytes`` compiles them (XLA's dot for bf16, the quantized-matmul
kernel for fp8). KV: one ragged-attention ``paged_attention`` call per layer (x 32) at page 256,
bf16 pages, or float8_e4m3fn pages with their f32 scales per token and kv head. All figures are
``cost_analysis()`` of the compiled programs: for a Pallas kernel that is only its declared
``CostEstimate``, a hand count of its block schedule (the compiler cannot see inside a Pallas
call), not a measurement; for XLA's dot it is XLA's own estimate. The paged cases let sequences
share cache pages (at most 8192 pages, so the arguments fit one chip); the kernel's count is per
table entry, so the figure is that of sequences with pages of their own.
"""

from __future__ import annotations

import sys

from quantized_matmul_bytes import BATCHES, LAYERS, compiled_bytes, step_bytes

from kernel_hub import get_kernel
from kernel_hub.bench.compile_check import filtered_libtpu_stderr, no_persistent_cache
from kernel_hub.topologies import tpu_device

CONTEXTS = (4096, 32768)
KV_HEADS, HEAD_DIM, PAGE = 8, 128, 256
MAX_CACHE_PAGES = 8192


def kv_bytes(generation: str, batch: int, context: int, kv_dtype: str | None) -> float:
    """cost_analysis() bytes of one decode step's attention over all layers."""
    ragged = get_kernel("ragged-attention")
    pages = batch * -(-context // PAGE)
    case = ragged.benchmark.paged_decode_case(
        batch, context, cache_pages=min(pages, MAX_CACHE_PAGES), kv_dtype=kv_dtype
    )

    def attention(*args):
        return case.fn(*args, implementation="pallas", **case.kwargs)

    return LAYERS * compiled_bytes(attention, case.args, tpu_device(generation))


def kv_bound(batch: int, context: int, itemsize: int, scale_bytes: int) -> int:
    """Every cached key and value (with its scale) read once, all layers."""
    return LAYERS * 2 * batch * context * KV_HEADS * (HEAD_DIM * itemsize + scale_bytes)


def main(generations: list[str]) -> None:
    print(
        "| gen | batch | context | bf16+bf16 GB | / bound | fp8 w + bf16 KV GB | "
        "fp8+fp8 GB | / bound | fp8+fp8 / bf16+bf16 | / bf16 bound |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for generation in generations:
        for batch in BATCHES:
            with filtered_libtpu_stderr(), no_persistent_cache():
                weights = step_bytes(generation, batch)
            for context in CONTEXTS:
                with filtered_libtpu_stderr(), no_persistent_cache():
                    kv16 = kv_bytes(generation, batch, context, None)
                    kv8 = kv_bytes(generation, batch, context, "float8_e4m3fn")
                bf16 = weights["bf16"] + kv16
                bf16_bound = weights["bf16 bound"] + kv_bound(batch, context, 2, 0)
                fp8 = weights["fp8"] + kv8
                fp8_bound = weights["fp8 bound"] + kv_bound(batch, context, 1, 4)
                print(
                    f"| {generation} | {batch} | {context // 1024}k | {bf16 / 1e9:,.1f} | "
                    f"{bf16 / bf16_bound:.3f} | {(weights['fp8'] + kv16) / 1e9:,.1f} | "
                    f"{fp8 / 1e9:,.1f} | {fp8 / fp8_bound:.3f} | {fp8 / bf16:.3f} | "
                    f"{fp8 / bf16_bound:.3f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main(sys.argv[1:] or ["v5e", "v6e"])
