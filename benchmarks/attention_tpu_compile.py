"""Compile the attention kernel's cases for v4, v5e, v5p and v6e without a TPU (libtpu).

    PYTHONPATH=. python benchmarks/attention_tpu_compile.py [--json out.json]

Records, per generation, case and pass (forward, backward): compile seconds (trace + lower +
compile, one process, persistent cache off) and the compiled program's memory analysis. Cases:
the kernel's benchmark CASES plus the paths Transformers takes that CASES leave out (key padding
in decode, packed segments, the dense-mask entry point with its in-graph structure check).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from kernel_hub.loader import load_kernel_dir

KERNEL_DIR = Path(__file__).resolve().parents[1] / "kernels" / "attention"
sys.path.insert(0, str(KERNEL_DIR / "tests"))
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from attention_helpers import TPU_TOPOLOGIES, tpu_compile  # noqa: E402

from kernel_hub.cases import KernelCase  # noqa: E402

MEMORY_FIELDS = (
    "argument_size_in_bytes",
    "output_size_in_bytes",
    "temp_size_in_bytes",
    "generated_code_size_in_bytes",
)


def extra_cases(attention) -> list[KernelCase]:
    def struct(*shape, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype)

    qkv_decode = (struct(8, 32, 16, 128), struct(8, 8, 32768, 128), struct(8, 8, 32768, 128))
    qkv_prefill = (struct(1, 32, 2048, 128), struct(1, 8, 2048, 128), struct(1, 8, 2048, 128))
    segments = (struct(1, 2048, dtype=jnp.int32), struct(1, 2048, dtype=jnp.int32))
    return [
        KernelCase(
            "decode-q16-kv32k-key-padding",
            attention.jax.dot_product_attention,
            (*qkv_decode, struct(8, 32768, dtype=jnp.bool_)),
            {"causal": True},
            differentiable=(0, 1, 2),
        ),
        KernelCase(
            "prefill-2k-segments-window512",
            attention.jax.dot_product_attention,
            (*qkv_prefill, None, *segments),
            {"causal": True, "sliding_window": 512},
            differentiable=(0, 1, 2),
        ),
        KernelCase(
            "prefill-2k-dense-mask",
            attention.dense_mask.attention_with_dense_mask,
            (*qkv_prefill, struct(1, 1, 2048, 2048, dtype=jnp.bool_)),
            {"causal": True},
            differentiable=(0, 1, 2),
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    attention = load_kernel_dir(KERNEL_DIR)
    results = []
    for generation in TPU_TOPOLOGIES:
        for case in [*attention.benchmark.CASES, *extra_cases(attention)]:
            for backward in (False, True):
                seconds, compiled = tpu_compile(case, generation, backward=backward)
                memory = compiled.memory_analysis()
                row = {
                    "generation": generation,
                    "case": case.name,
                    "pass": "backward" if backward else "forward",
                    "compile_s": round(seconds, 2),
                    **{field: getattr(memory, field) for field in MEMORY_FIELDS},
                }
                results.append(row)
                print(
                    f"{generation:4s} {case.name:32s} {row['pass']:8s} {seconds:6.2f} s  "
                    f"temp {row['temp_size_in_bytes'] / 2**20:8.1f} MiB  "
                    f"args {row['argument_size_in_bytes'] / 2**20:8.1f} MiB",
                    flush=True,
                )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
