"""CPU time of the attention kernel's torch op against torch SDPA, one process.

    PYTHONPATH=. python benchmarks/attention_cpu.py [--repeats 10] [--torch-threads N] [--json F]

Shapes: Llama-3-8B-like heads (32 query, 8 kv, head_dim 128), f32, causal; prefill of 512 tokens
(forward, and forward + backward) and one decode token against a 4096-token KV cache. The kernel
path is the torch op (DLPack to JAX and back) with each implementation that runs on CPU: ``xla``
(the default on CPU) and ``pallas`` (the TPU kernel in interpret mode, a correctness tool on CPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kernel_hub.loader import load_kernel_dir
from kernel_hub.platform import describe_host

KERNEL_DIR = Path(__file__).resolve().parents[1] / "kernels" / "attention"
SHAPES = {"prefill-512": (1, 32, 8, 512, 512, 128), "decode-kv4096": (1, 32, 8, 1, 4096, 128)}


def _time_ms(fn, repeats: int) -> dict[str, float]:
    fn()  # compile / warm up
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return {"min_ms": min(samples), "median_ms": statistics.median(samples)}


def _inputs(shape, requires_grad: bool):
    batch, q_heads, kv_heads, q_len, kv_len, head_dim = shape
    generator = torch.Generator().manual_seed(0)

    def make(*dims):
        return torch.randn(*dims, generator=generator).requires_grad_(requires_grad)

    return (
        make(batch, q_heads, q_len, head_dim),
        make(batch, kv_heads, kv_len, head_dim),
        make(batch, kv_heads, kv_len, head_dim),
    )


def _runners(attention, shape, backward: bool):
    q, k, v = _inputs(shape, backward)

    def step(fn):
        def run():
            out = fn()
            if backward:
                out.sum().backward()

        return run

    runners = {
        "torch_sdpa": step(
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=shape[3] > 1, enable_gqa=True)
        ),
    }
    for implementation in ("xla", "pallas"):
        runners[f"kernel_op_{implementation}"] = step(
            lambda implementation=implementation: attention.dot_product_attention(
                q, k, v, causal=True, implementation=implementation
            )
        )
    return runners


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--torch-threads", type=int, help="torch.set_num_threads before timing")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    attention = load_kernel_dir(KERNEL_DIR)
    results = {"host": describe_host(), "torch_threads": torch.get_num_threads(), "cases": {}}
    for name, shape in SHAPES.items():
        passes = (False, True) if name.startswith("prefill") else (False,)
        for backward in passes:
            label = f"{name}{'-fwd+bwd' if backward else '-fwd'}"
            for runner, fn in _runners(attention, shape, backward).items():
                timing = _time_ms(fn, args.repeats)
                results["cases"].setdefault(label, {})[runner] = timing
                print(
                    f"{label:24s} {runner:18s} min {timing['min_ms']:9.2f} ms  "
                    f"median {timing['median_ms']:9.2f} ms",
                    flush=True,
                )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
