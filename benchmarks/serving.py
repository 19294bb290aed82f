"""Serving benchmark: continuous batching, stock versus kernelized, and TPU compile figures.

Part 1 (CPU): ``generate_batch`` on tiny and medium (hidden 1024, 8 layers) Llama and Mixtral,
random weights, f32, greedy. In one process per model: stock Transformers (sdpa continuous
batching), then the kernelized model twice (cold: compiles included; warm: the same requests
again). Prints generated tokens/s for each, whether the kernelized tokens equal the stock ones,
and the number of XLA compilations in each kernelized run (JAX's backend-compile events). On a
CPU the kernels run as their XLA implementations through the torch bridge, so these figures say
what bridging costs and that compilations stay bounded; they say nothing about TPU speed.

Part 2 (no TPU needed): deviceless Mosaic compiles of the ragged and paged kernels at Llama-3-8B /
Mixtral-8x7B decode shapes (32 query heads, 8 kv heads, D 128, bf16), batch 64 and 256, context
2k and 32k, and of moe-gemm's gmm at decode (T = 1..256, E = 8/64/128, top-k 2/8), for v5e and
v6e: compile time, argument and temporary (HBM) bytes, or the error; a VMEM overflow is retried
with halved kv blocks until a size fits.

    python benchmarks/serving.py [--models tiny-llama,tiny-mixtral,medium-llama,medium-mixtral]
        [--requests 16] [--new-tokens 16] [--tpu v5e,v6e] [--json out.json]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # torch and XLA share the cores

import argparse
import copy
import dataclasses
import json
import time
from typing import Any

import jax
import torch

import kernel_hub
from kernel_hub.layers.integrations.continuous_batching import generate_batch

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileCounter:
    """Counts XLA backend compilations (all of this process's JAX work)."""

    def __init__(self) -> None:
        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._event)

    def _event(self, name: str, _seconds: float, **_: Any) -> None:
        if name == COMPILE_EVENT:
            self.count += 1


def build(name: str) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    size, family = name.split("-")
    common = dict(
        vocab_size=512,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=None,
        max_position_embeddings=512,
    )
    if size == "tiny":
        common.update(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
        )
    else:
        common.update(
            hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4
        )
    torch.manual_seed(0)
    if family == "llama":
        config = LlamaConfig(intermediate_size=4 * common["hidden_size"], **common)
        return LlamaForCausalLM(config).eval()
    config = MixtralConfig(
        intermediate_size=2 * common["hidden_size"],
        num_local_experts=8,
        num_experts_per_tok=2,
        **common,
    )
    return MixtralForCausalLM(config).eval()


def prompts(count: int) -> list[list[int]]:
    """Prompt lengths 8..71 tokens, so prefill chunks and decode mix in one batch."""
    return [[(11 * i + 7 * j) % 500 + 2 for j in range(8 + (13 * i) % 64)] for i in range(count)]


def run(model, inputs, new_tokens: int, batch_tokens: int, helper) -> tuple[list, float]:
    from transformers import ContinuousBatchingConfig, GenerationConfig

    greedy = GenerationConfig(
        max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0
    )
    config = ContinuousBatchingConfig(
        num_blocks=256,
        max_batch_tokens=batch_tokens,
        page_size=32,
        max_requests_per_batch=len(inputs),
    )
    start = time.perf_counter()
    with torch.no_grad():
        results = helper(model, inputs, generation_config=greedy, continuous_batching_config=config)
    seconds = time.perf_counter() - start
    tokens = [results[f"req_{i}"].generated_tokens for i in range(len(inputs))]
    return tokens, seconds


def stock_generate_batch(model, inputs, **kwargs):
    return model.generate_batch(inputs, **kwargs)


def serving_rows(models: list[str], requests: int, new_tokens: int, batch_tokens: int) -> list:
    counter = CompileCounter()
    rows = []
    inputs = prompts(requests)
    generated = requests * new_tokens
    for name in models:
        stock = build(name)
        model = copy.deepcopy(stock)
        expected, stock_s = run(stock, inputs, new_tokens, batch_tokens, stock_generate_batch)
        report = kernel_hub.kernelize(model)
        before = counter.count
        cold_tokens, cold_s = run(model, inputs, new_tokens, batch_tokens, generate_batch)
        cold_compiles = counter.count - before
        before = counter.count
        warm_tokens, warm_s = run(model, inputs, new_tokens, batch_tokens, generate_batch)
        rows.append(
            {
                "model": name,
                "swapped": report.counts(),
                "stock_tokens_per_s": generated / stock_s,
                "kernelized_cold_tokens_per_s": generated / cold_s,
                "kernelized_warm_tokens_per_s": generated / warm_s,
                "compiles_cold": cold_compiles,
                "compiles_warm": counter.count - before,
                "tokens_equal_stock": cold_tokens == expected and warm_tokens == expected,
            }
        )
        print(
            f"{name:15} stock {rows[-1]['stock_tokens_per_s']:7.1f} tok/s | kernelized cold "
            f"{rows[-1]['kernelized_cold_tokens_per_s']:7.1f} tok/s ({cold_compiles} compiles), "
            f"warm {rows[-1]['kernelized_warm_tokens_per_s']:7.1f} tok/s "
            f"({rows[-1]['compiles_warm']} compiles) | tokens equal: "
            f"{rows[-1]['tokens_equal_stock']}",
            flush=True,
        )
    return rows


def _smaller_blocks(case) -> Any:
    """The case with its kv blocks halved (ragged: block_k; paged: pages_per_block), or None."""
    kwargs = dict(case.kwargs)
    key = "pages_per_block" if "pages_per_block" in kwargs else "block_k"
    if kwargs.get(key) is None or kwargs[key] <= (1 if key == "pages_per_block" else 128):
        return None
    kwargs[key] //= 2
    return dataclasses.replace(
        case, kwargs=kwargs, name=f"{case.name.split('@')[0]}@{key}={kwargs[key]}"
    )


def _compile_fitting(kernel, case, generation):
    """Compile; on a VMEM overflow retry with smaller kv blocks and report the ones that fit."""
    from kernel_hub.bench.compile_check import compile_case

    attempts = []
    while case is not None:
        result = compile_case(kernel.manifest.name, case, generation)
        attempts.append((case, result))
        vmem = result.vmem_overflow and "HBM" not in (result.error or "")
        if result.ok or not vmem:
            break
        case = _smaller_blocks(case)
    return attempts


def _row(case, generation: str, result) -> dict:
    memory = result.memory or {}
    row = {
        "case": case.name,
        "generation": generation,
        "ok": result.ok,
        "seconds": result.seconds,
        "argument_bytes": memory.get("argument_size"),
        "temp_bytes": memory.get("temp_size"),
        "error": (result.error or "")[:300],
    }
    gib, mib = (memory.get("argument_size") or 0) / 2**30, (memory.get("temp_size") or 0) / 2**20
    outcome = (
        f"ok {result.seconds:5.1f} s, arguments {gib:6.2f} GiB, temp {mib:7.2f} MiB"
        if result.ok
        else f"FAIL {(result.error or '')[:160]}"
    )
    print(f"{case.name:46} {generation}: {outcome}", flush=True)
    return row


def compile_rows(generations: list[str]) -> list:
    """Every serving case of the ragged-attention and moe-gemm kernels, Pallas, forward."""
    return [
        _row(case, generation, result)
        for kernel in (kernel_hub.get_kernel(op) for op in ("ragged-attention", "moe-gemm"))
        for first in kernel.benchmark.SERVING_CASES
        for generation in generations
        for case, result in _compile_fitting(kernel, first, generation)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny-llama,tiny-mixtral,medium-llama,medium-mixtral")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--batch-tokens", type=int, default=64, help="max_batch_tokens")
    parser.add_argument("--tpu", default="v5e,v6e", help="generations; '' skips part 2")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    models = [m for m in args.models.split(",") if m]
    record = {
        "command": "python benchmarks/serving.py "
        + " ".join(
            f"--{k.replace('_', '-')} {v!r}" for k, v in vars(args).items() if v is not None
        ),
        "serving": serving_rows(models, args.requests, args.new_tokens, args.batch_tokens),
        "tpu_compile": compile_rows([g for g in args.tpu.split(",") if g]),
    }
    if args.json:
        with open(args.json, "w") as out:
            json.dump(record, out, indent=1)


if __name__ == "__main__":
    main()
