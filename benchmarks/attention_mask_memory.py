"""Temporary HBM of the flash kernel under real-batch masks, from deviceless TPU compiles.

Llama-3-8B attention (32 query heads, 8 kv heads, head dim 128, bf16, causal), compiled for a TPU
generation without a TPU (libtpu deviceless topologies), forward and forward + backward, with:

* ``unpadded``: no mask beyond the causal rule (the reference point);
* ``padded``: key padding ``kv_mask [B, S]`` (what Transformers' padded batch becomes);
* ``image-prefix``: Gemma-3-style image tokens (a 256-token block per 1024 tokens seeing each
  other bidirectionally: ``q_groups``/``kv_groups [B, S]``) plus key padding.

Temporary bytes are XLA's ``memory_analysis().temp_size_in_bytes`` of the compiled program: a
model of the TPU's HBM use, not a measurement on a chip. Each row's ratio is to ``unpadded``.

    python benchmarks/attention_mask_memory.py [--generations v5e,v6e]
        [--shapes 2x8192,1x32768] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from kernel_hub.bench.compile_check import compile_case
from kernel_hub.loading.loader import load_kernel_dir
from kernel_hub.paths import kernels_dir

DIRECTIONS = {"forward": "forward", "backward": "forward+backward"}


def measure(generations: Sequence[str], shapes: Sequence[tuple[int, int]]) -> list[dict[str, Any]]:
    benchmark = load_kernel_dir(kernels_dir() / "attention").benchmark
    rows = []
    for generation in generations:
        for batch, length in shapes:
            for direction in DIRECTIONS:
                reference = None
                for mask in benchmark.MEMORY_MASKS:
                    case = benchmark.mask_memory_case(mask, batch, length)
                    result = compile_case("attention", case, generation, direction)
                    temp = result.memory.get("temp_size") if result.ok else None
                    if mask == "unpadded":
                        reference = temp
                    rows.append(
                        {
                            "generation": generation,
                            "batch": batch,
                            "length": length,
                            "direction": DIRECTIONS[direction],
                            "mask": mask,
                            "temp_bytes": temp,
                            "argument_bytes": result.memory.get("argument_size"),
                            "ratio": temp / reference if temp and reference else None,
                            "seconds": round(result.seconds, 1),
                            "error": result.error,
                        }
                    )
                    print(_line(rows[-1]), flush=True)
    return rows


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:,.0f} MiB"


def _line(row: dict[str, Any]) -> str:
    ratio = "-" if row["ratio"] is None else f"{row['ratio']:.3f}"
    return (
        f"| {row['generation']} | {row['batch']} x {row['length']} | {row['direction']} | "
        f"{row['mask']} | {_mib(row['temp_bytes'])} | {ratio} | {row['error'] or ''} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--generations", default="v5e,v6e")
    parser.add_argument("--shapes", default="2x8192,1x32768", help="BATCHxLENGTH, comma separated")
    parser.add_argument("--json", help="write the rows here")
    options = parser.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in options.shapes.split(",")]
    print("| TPU | B x S | direction | mask | temp HBM | / unpadded | error |")
    print("|---|---|---|---|---|---|---|")
    rows = measure(options.generations.split(","), shapes)
    if options.json:
        with open(options.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
