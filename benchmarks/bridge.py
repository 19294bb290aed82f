"""Cost of the torch -> JAX -> torch bridge, in one run.

    PYTHONPATH=. python benchmarks/bridge.py [--quick] [--json out.json]

Prints:
* per-call time of a (8, 128) f32 RMSNorm: torch's ``F.rms_norm``, a jitted JAX call on JAX
  arrays, and kernel-hub's bridged op (``get_kernel("rmsnorm").rms_norm``);
* a tiny Llama forward (batch 1, 16 tokens), stock and with its RMSNorm layers swapped to the
  kernel's ``layers.RMSNorm.forward``;
* compilations during a 64-token ``generate()`` of that kernelized model, with and without the KV
  cache (the bridge's own count and JAX's backend-compile events);
* the first bridged call in a fresh process with a cold and with a warm persistent compilation
  cache, and the per-call time under each thread policy (subprocesses).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SHAPE = (8, 128)
EPS = 1e-6


def per_call_us(fn: Callable[[], Any], calls: int, warmup: int = 50) -> dict[str, float]:
    """Min and median wall time of one ``fn()`` call, in microseconds."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return {"min_us": min(samples) * 1e6, "median_us": statistics.median(samples) * 1e6}


def _rmsnorm():
    from kernel_hub import get_kernel

    return get_kernel("rmsnorm")


def bench_per_call(calls: int) -> dict[str, dict[str, float]]:
    import jax
    import torch
    import torch.nn.functional as F

    kernel = _rmsnorm()
    x, w = torch.randn(*SHAPE), torch.randn(SHAPE[-1])
    jx, jw = jax.numpy.asarray(x.numpy()), jax.numpy.asarray(w.numpy())
    jitted = jax.jit(lambda a, b: kernel.jax.rms_norm(a, b, EPS))
    return {
        "torch F.rms_norm": per_call_us(lambda: F.rms_norm(x, SHAPE[-1:], w, EPS), calls),
        "jax.jit on JAX arrays": per_call_us(lambda: jitted(jx, jw).block_until_ready(), calls),
        "kernel-hub bridged op": per_call_us(lambda: kernel.rms_norm(x, w, EPS), calls),
    }


def tiny_llama():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return LlamaForCausalLM(config).eval()


def kernelize_rmsnorm(model) -> int:
    """Swap every ``*RMSNorm`` layer's forward to the kernel's; how many were swapped."""
    layer = _rmsnorm().layers.RMSNorm
    swapped = 0
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = types.MethodType(layer.forward, module)
            swapped += 1
    return swapped


def bench_llama(calls: int) -> dict[str, Any]:
    import torch

    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(ids).logits
        stock = per_call_us(lambda: model(ids), calls, warmup=5)
        swapped = kernelize_rmsnorm(model)
        kernelized = per_call_us(lambda: model(ids), calls, warmup=5)
        error = (model(ids).logits - expected).abs().max().item()
    return {
        "stock": stock,
        "kernelized": kernelized,
        "rmsnorm_layers_swapped": swapped,
        "ratio_median": kernelized["median_us"] / stock["median_us"],
        "max_abs_logit_diff": error,
    }


def count_generate_compiles(new_tokens: int) -> dict[str, Any]:
    import jax
    import torch

    from kernel_hub.runtimes.aot import compilations

    backend_compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, _secs, **_: (
            backend_compiles.append(event)
            if event == "/jax/core/compile/backend_compile_duration"
            else None
        )
    )
    model = tiny_llama()
    kernelize_rmsnorm(model)
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(1))
    result = {}
    for use_cache in (True, False):
        before, backend_before = compilations(), len(backend_compiles)
        with torch.no_grad():
            out = model.generate(
                ids,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                use_cache=use_cache,
                pad_token_id=0,
            )
        result["with KV cache" if use_cache else "without KV cache"] = {
            "new_tokens": out.shape[1] - ids.shape[1],
            "bridge_compilations": compilations() - before,
            "xla_backend_compiles": len(backend_compiles) - backend_before,
        }
    return result


def first_call_child() -> None:
    """Run in a subprocess: time imports and the first bridged call, print JSON."""
    start = time.perf_counter()
    import torch

    kernel = _rmsnorm()
    loaded = time.perf_counter()
    x, w = torch.randn(*SHAPE), torch.randn(SHAPE[-1])
    kernel.rms_norm(x, w, EPS)
    first = time.perf_counter()
    print(json.dumps({"import_and_load_s": loaded - start, "first_call_s": first - loaded}))


def per_call_child() -> None:
    """Run in a subprocess: per-call time of the bridged op, print JSON."""
    import torch

    kernel = _rmsnorm()
    x, w = torch.randn(*SHAPE), torch.randn(SHAPE[-1])
    print(json.dumps(per_call_us(lambda: kernel.rms_norm(x, w, EPS), 3000)))


def _child(mode: str, env: dict[str, str]) -> dict[str, float]:
    completed = subprocess.run(
        [sys.executable, __file__, mode],
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    return json.loads(completed.stdout.strip().splitlines()[-1])


def bench_first_call() -> dict[str, dict[str, float]]:
    with tempfile.TemporaryDirectory(prefix="kernel-hub-cache-") as cache:
        env = {"KERNEL_HUB_COMPILATION_CACHE_DIR": cache}
        return {
            "cache off": _child("--first-call", {"KERNEL_HUB_COMPILATION_CACHE": "0"}),
            "cold cache": _child("--first-call", env),
            "warm cache": _child("--first-call", env),
        }


def bench_thread_policies() -> dict[str, dict[str, float]]:
    return {
        policy: _child("--per-call", {"KERNEL_HUB_THREADS": policy})
        for policy in ("inline", "default")
    }


def _print_table(title: str, rows: dict[str, dict[str, float]], unit: str, scale: float) -> None:
    print(f"\n{title}")
    for name, values in rows.items():
        cells = "  ".join(
            f"{key.removesuffix('_us').removesuffix('_s')} {value * scale:9.1f}"
            for key, value in values.items()
        )
        print(f"  {name:28s} {cells} {unit}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer calls (noisier)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    calls = 500 if args.quick else 3000

    import torch

    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, cpus {os.cpu_count()}, "
        f"load {os.getloadavg()[0]:.1f}"
    )
    results: dict[str, Any] = {"per_call": bench_per_call(calls)}
    _print_table(f"Per call, {SHAPE} f32 RMSNorm", results["per_call"], "us", 1)
    results["llama_forward"] = bench_llama(50 if args.quick else 200)
    llama = results["llama_forward"]
    _print_table(
        "Tiny Llama forward, batch 1, 16 tokens",
        {"stock": llama["stock"], "kernelized": llama["kernelized"]},
        "us",
        1,
    )
    print(
        f"  kernelized / stock (median): {llama['ratio_median']:.2f}x, "
        f"{llama['rmsnorm_layers_swapped']} layers swapped, "
        f"max |logit diff| {llama['max_abs_logit_diff']:.2e}"
    )
    results["generate_compiles"] = count_generate_compiles(64)
    print("\nCompilations during generate(64 new tokens) of the kernelized tiny Llama")
    for name, row in results["generate_compiles"].items():
        print(
            f"  {name:18s} {row['new_tokens']} tokens: {row['bridge_compilations']} bridge "
            f"executables, {row['xla_backend_compiles']} XLA backend compiles"
        )
    results["first_call"] = bench_first_call()
    _print_table("First bridged call in a fresh process", results["first_call"], "ms", 1e3)
    results["thread_policies"] = bench_thread_policies()
    _print_table("Bridged per-call time by thread policy", results["thread_policies"], "us", 1)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    if sys.argv[1:2] == ["--first-call"]:
        first_call_child()
    elif sys.argv[1:2] == ["--per-call"]:
        per_call_child()
    else:
        main()
