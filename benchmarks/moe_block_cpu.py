"""CPU forward time of a Mixtral MoE block (router + experts) per experts implementation.

Compares Transformers' ``eager`` and ``grouped_mm`` experts with the moe-gemm kernel's
``experts_forward`` running each gmm implementation (xla_loop, xla, tokamax, pallas in interpret
mode). One process, f32, random weights, E=8, H=1024, I=2048, top-2 by default.

    python benchmarks/moe_block_cpu.py [--tokens 1 16 256] [--repeats 20] \
        [--json benchmarks/moe_block_cpu.json]

The recorded run is benchmarks/moe_block_cpu.json (benchmarks/results/ holds only
``kernel-hub bench`` / ``compile-check`` records).

OMP_WAIT_POLICY defaults to PASSIVE here: with JAX's CPU client in the same process, torch's
spinning OpenMP workers and XLA's threads fight over the cores and every torch op slows down
(eager experts: ~250 ms instead of ~4 ms at one token on a 2-core machine).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts its OpenMP pool

import argparse
import json
import statistics
import time

import jax
import torch
from transformers import MixtralConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

from kernel_hub.loading.resolver import get_kernel
from kernel_hub.platform import describe_host


def build_block(hidden: int, intermediate: int, experts: int, top_k: int) -> MixtralSparseMoeBlock:
    config = MixtralConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_local_experts=experts,
        num_experts_per_tok=top_k,
    )
    torch.manual_seed(0)
    block = MixtralSparseMoeBlock(config).eval()
    for parameter in block.parameters():
        torch.nn.init.normal_(parameter, std=0.02)
    return block


def use_only(kernel, implementation: str) -> None:
    """Make the kernel's ops run ``implementation`` on CPU from now on.

    The choice is made when a JAX function is traced, and traces are cached per shape: drop
    them, or the first implementation traced keeps running.
    """
    for table in kernel.implementation_tables:
        table.set_order("cpu", [implementation])
    jax.clear_caches()


def time_ms(fn, repeats: int) -> tuple[float, float]:
    """(min, median) wall time in ms after two warm-up calls (compiles happen there)."""
    fn()
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return min(samples), statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()

    kernel = get_kernel("moe-gemm")
    name = kernel.integrations.register()
    block = build_block(args.hidden, args.intermediate, args.experts, args.top_k)
    default_order = kernel.jax.GMM_TABLE.order("cpu")
    variants = [("eager", None), ("grouped_mm", None)] + [
        (f"{name}[{impl}]", impl) for impl in default_order
    ]

    results = []
    threads, wait_policy = torch.get_num_threads(), os.environ["OMP_WAIT_POLICY"]
    print(f"torch threads: {threads}, OMP_WAIT_POLICY={wait_policy}")
    print(f"{'tokens':>6}  {'implementation':<32} {'min ms':>8} {'median ms':>10}")
    for tokens in args.tokens:
        x = torch.randn(1, tokens, args.hidden)
        for label, impl in variants:
            block.experts.config._experts_implementation_internal = label.split("[")[0]
            if impl is not None:
                use_only(kernel, impl)
            with torch.no_grad():
                fastest, median = time_ms(lambda x=x: block(x), args.repeats)
            print(f"{tokens:>6}  {label:<32} {fastest:>8.2f} {median:>10.2f}", flush=True)
            results.append(
                {"tokens": tokens, "implementation": label, "min_ms": fastest, "median_ms": median}
            )
    if args.json:
        record = {
            "host": describe_host(),
            "load_average": os.getloadavg(),
            "torch_threads": threads,
            "omp_wait_policy": wait_policy,
            "shape": {
                "hidden": args.hidden,
                "intermediate": args.intermediate,
                "experts": args.experts,
                "top_k": args.top_k,
                "dtype": "float32",
            },
            "repeats": args.repeats,
            "results": results,
        }
        with open(args.json, "w") as handle:
            json.dump(record, handle, indent=2)


if __name__ == "__main__":
    main()
