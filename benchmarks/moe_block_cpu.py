"""CPU forward time of a Mixtral MoE block (router + experts) per experts implementation.

Compares Transformers' ``eager`` and ``grouped_mm`` experts with the moe-gemm kernel's
``experts_forward`` running each gmm implementation (xla, tokamax, pallas in interpret mode).
One process, f32, random weights, E=8, H=1024, I=2048, top-2 by default.

    PYTHONPATH=. python benchmarks/moe_block_cpu.py [--tokens 1 16 256] [--repeats 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import MixtralConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

from kernel_hub.resolver import get_kernel


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
    table = kernel.jax.GMM_TABLE
    default_order = table.order("cpu")
    variants = [("eager", None), ("grouped_mm", None)] + [
        (f"{name}[{impl}]", impl) for impl in ("xla", "tokamax", "pallas")
    ]

    results = []
    print(f"torch threads: {torch.get_num_threads()}")
    print(f"{'tokens':>6}  {'implementation':<32} {'min ms':>8} {'median ms':>10}")
    for tokens in args.tokens:
        x = torch.randn(1, tokens, args.hidden)
        for label, impl in variants:
            block.experts.config._experts_implementation_internal = label.split("[")[0]
            if impl is not None:
                table.set_order("cpu", [impl])
            with torch.no_grad():
                fastest, median = time_ms(lambda x=x: block(x), args.repeats)
            table.set_order("cpu", default_order)
            print(f"{tokens:>6}  {label:<32} {fastest:>8.2f} {median:>10.2f}", flush=True)
            results.append(
                {"tokens": tokens, "implementation": label, "min_ms": fastest, "median_ms": median}
            )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=2)


if __name__ == "__main__":
    main()
