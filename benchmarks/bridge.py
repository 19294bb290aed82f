"""Cost of the torch -> JAX -> torch bridge, in one run.

    python benchmarks/bridge.py [--quick] [--json out.json]
    python benchmarks/bridge.py --compare OTHER_CHECKOUT [--rounds 4]

Prints:
* per-call time of a (8, 128) f32 RMSNorm: torch's ``F.rms_norm``, a jitted JAX call on JAX
  arrays, and kernel-hub's bridged op (``get_kernel("rmsnorm").rms_norm``), measured in
  alternating rounds so all three see the same machine load;
* a tiny Llama forward (batch 1, 16 tokens), stock and with its RMSNorm layers' forward swapped to
  the kernel's ``layers.RMSNorm.forward``, with torch's default threads and with one thread;
* compilations during a 64-token ``generate()`` of that kernelized model in a fresh process, with
  and without the KV cache (the bridge's own count and JAX's backend-compile events);
* the first bridged call in a fresh process with a cold and with a warm persistent compilation
  cache, and the per-call time under each thread policy (subprocesses).

Timings on a shared machine are noisy: the load average is printed with the results.
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


def _samples(fn: Callable[[], Any], calls: int) -> list[float]:
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return samples


def compare(fns: dict[str, Callable[[], Any]], calls: int, rounds: int) -> dict[str, dict]:
    """Min and median microseconds per call of each fn, measured in alternating rounds."""
    for fn in fns.values():
        _samples(fn, max(5, calls // 20))
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            samples[name] += _samples(fn, calls)
    return {
        name: {"min_us": min(s) * 1e6, "median_us": statistics.median(s) * 1e6}
        for name, s in samples.items()
    }


def _rmsnorm():
    from kernel_hub import get_kernel

    return get_kernel("rmsnorm")


def bench_per_call(calls: int, rounds: int) -> dict[str, dict]:
    """torch's RMSNorm and kernel-hub's, as an op and as a layer swapped into Llama's norm (what
    kernelize does), each per call under ``torch.no_grad``, with the ratios of the medians to
    torch's."""
    import torch
    import torch.nn.functional as F
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    kernel = _rmsnorm()
    x, w = torch.randn(*SHAPE), torch.randn(SHAPE[-1])
    kernel.rms_norm(x, w, EPS)  # kernel-hub starts JAX (and applies its thread policy) first

    import jax

    jx, jw = jax.numpy.asarray(x.numpy()), jax.numpy.asarray(w.numpy())
    jitted = jax.jit(lambda a, b: kernel.jax.rms_norm(a, b, EPS))
    module = torch.nn.RMSNorm(SHAPE[-1], eps=EPS)
    stock = LlamaRMSNorm(SHAPE[-1], eps=EPS)
    layer = LlamaRMSNorm(SHAPE[-1], eps=EPS)
    kernelize_rmsnorm([layer])
    with torch.no_grad():
        times = compare(
            {
                "torch F.rms_norm": lambda: F.rms_norm(x, SHAPE[-1:], w, EPS),
                "torch nn.RMSNorm module": lambda: module(x),
                "Transformers LlamaRMSNorm": lambda: stock(x),
                "jax.jit on JAX arrays": lambda: jitted(jx, jw).block_until_ready(),
                "kernel-hub bridged op": lambda: kernel.rms_norm(x, w, EPS),
                "kernel-hub RMSNorm layer": lambda: layer(x),
            },
            calls,
            rounds,
        )
    native = times["torch F.rms_norm"]
    for name in ("kernel-hub bridged op", "kernel-hub RMSNorm layer"):
        times[name]["ratio_to_F_rms_norm"] = times[name]["median_us"] / native["median_us"]
    layer_times = times["kernel-hub RMSNorm layer"]
    layer_times["ratio_to_nn_RMSNorm"] = (
        layer_times["median_us"] / times["torch nn.RMSNorm module"]["median_us"]
    )
    layer_times["ratio_to_LlamaRMSNorm"] = (
        layer_times["median_us"] / times["Transformers LlamaRMSNorm"]["median_us"]
    )
    return times


def tiny_llama():
    from transformers import LlamaForCausalLM

    from kernel_hub.models.tiny import tiny_model

    return tiny_model(LlamaForCausalLM)


def rmsnorm_layers(model) -> list:
    return [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]


def kernelize_rmsnorm(layers: list) -> None:
    """Swap each layer's forward to the kernel's (per instance; the class stays untouched)."""
    forward = _rmsnorm().layers.RMSNorm.forward
    for layer in layers:
        layer.forward = types.MethodType(forward, layer)


def bench_llama(calls: int, rounds: int) -> dict[str, Any]:
    import torch

    model = tiny_llama()
    layers = rmsnorm_layers(model)
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(0))
    kernelized = tiny_llama()
    kernelize_rmsnorm(rmsnorm_layers(kernelized))
    result: dict[str, Any] = {"rmsnorm_layers": len(layers)}
    default_threads = torch.get_num_threads()
    with torch.no_grad():
        error = (kernelized(ids).logits - model(ids).logits).abs().max().item()
        for threads in dict.fromkeys((default_threads, 1)):
            torch.set_num_threads(threads)
            times = compare(
                {"stock": lambda: model(ids), "kernelized": lambda: kernelized(ids)}, calls, rounds
            )
            times["ratio_median"] = times["kernelized"]["median_us"] / times["stock"]["median_us"]
            times["ratio_min"] = times["kernelized"]["min_us"] / times["stock"]["min_us"]
            result[f"torch threads {threads}"] = times
    torch.set_num_threads(default_threads)
    result["max_abs_logit_diff"] = error
    return result


def generate_child() -> None:
    """Run in a fresh process: compilations during generate(), print JSON."""
    import jax
    import torch

    from kernel_hub.bridge.runtimes.aot import compilations

    backend_compiles = []

    def on_duration(event: str, _secs: float, **_: Any) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            backend_compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    model = tiny_llama()
    layers = rmsnorm_layers(model)
    kernelize_rmsnorm(layers)
    row_counts: set[int] = set()
    for layer in layers:
        layer.register_forward_pre_hook(lambda _m, args: row_counts.add(args[0].shape[:-1].numel()))
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(1))
    result = {}
    for use_cache in (True, False):
        before, backend_before = compilations(), len(backend_compiles)
        row_counts.clear()
        with torch.no_grad():
            out = model.generate(
                ids,
                max_new_tokens=64,
                min_new_tokens=64,
                do_sample=False,
                use_cache=use_cache,
                pad_token_id=0,
            )
        result["with KV cache" if use_cache else "without KV cache"] = {
            "new_tokens": out.shape[1] - ids.shape[1],
            "distinct_row_counts": len(row_counts),
            "bridge_compilations": compilations() - before,
            "xla_backend_compiles": len(backend_compiles) - backend_before,
        }
    print(json.dumps(result))


def first_call_child() -> None:
    """Run in a fresh process: time imports, JAX start and the first bridged call; print JSON."""
    start = time.perf_counter()
    import torch

    from kernel_hub.bridge.runtimes.dlpack import RUNTIME

    kernel = _rmsnorm()
    loaded = time.perf_counter()
    RUNTIME.check_device(torch.device("cpu"))  # starts JAX's CPU backend (as a first call would)
    started = time.perf_counter()
    kernel.rms_norm(torch.randn(*SHAPE), torch.randn(SHAPE[-1]), EPS)
    first = time.perf_counter()
    print(
        json.dumps(
            {
                "import_and_load_s": loaded - start,
                "jax_start_s": started - loaded,
                "first_call_s": first - started,
            }
        )
    )


def per_call_table_child() -> None:
    """Run in a fresh process: the per-call table (``bench_per_call``), print JSON. Used to
    compare two checkouts in alternating processes (``PYTHONPATH`` picks the checkout)."""
    print(json.dumps({"load_average": os.getloadavg()[0], **bench_per_call(250, 4)}))


def per_call_child() -> None:
    """Run in a fresh process: per-call time of the bridged op, print JSON."""
    import torch

    kernel = _rmsnorm()
    x, w = torch.randn(*SHAPE), torch.randn(SHAPE[-1])
    print(json.dumps(compare({"op": lambda: kernel.rms_norm(x, w, EPS)}, 1000, 3)["op"]))


def _child(mode: str, env: dict[str, str]) -> dict[str, Any]:
    completed = subprocess.run(
        [sys.executable, __file__, mode],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=600,
    )
    if completed.returncode != 0:
        raise RuntimeError(f"{mode} child failed:\n{completed.stderr[-3000:]}")
    return json.loads(completed.stdout.strip().splitlines()[-1])


def compare_checkouts(other: Path, rounds: int) -> dict[str, Any]:
    """The per-call table of this checkout and of ``other`` (e.g. an export of main), in
    alternating fresh processes (``rounds`` each, the order flipped every round); medians."""
    trees = {"other": other.resolve(), "this": ROOT}
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for round_ in range(rounds):
        order = list(trees.items()) if round_ % 2 == 0 else list(trees.items())[::-1]
        for name, tree in order:
            env = {"PYTHONPATH": str(tree), "JAX_PLATFORMS": "cpu"}
            runs[name].append(_child("--per-call-table", env))
    rows = [row for row in runs["this"][0] if row != "load_average"]
    return {
        name: {
            "load_averages": [run["load_average"] for run in tree_runs],
            **{
                row: {
                    key: statistics.median(run[row][key] for run in tree_runs)
                    for key in tree_runs[0][row]
                }
                for row in rows
            },
        }
        for name, tree_runs in runs.items()
    }


def _median_of(runs: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def bench_first_call(repeats: int) -> dict[str, dict[str, float]]:
    """Pairs of fresh processes on a fresh cache directory: the first fills it, the second reads."""
    cold, warm = [], []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory(prefix="kernel-hub-cache-") as cache:
            env = {"KERNEL_HUB_COMPILATION_CACHE_DIR": cache}
            cold.append(_child("--first-call", env))
            warm.append(_child("--first-call", env))
    return {"cold cache": _median_of(cold), "warm cache": _median_of(warm)}


def bench_thread_policies() -> dict[str, dict[str, float]]:
    return {
        policy: _child("--per-call", {"KERNEL_HUB_THREADS": policy})
        for policy in ("inline", "default")
    }


def _print_rows(title: str, rows: dict[str, dict[str, float]], unit: str, scale: float) -> None:
    if title:
        print(f"\n{title}")
    for name, values in rows.items():
        cells = "  ".join(
            f"{key.removesuffix('_us').removesuffix('_s')} {value * scale:8.1f} {unit}"
            for key, value in values.items()
            if not key.startswith("ratio")
        )
        ratios = "  ".join(
            f"{key.removeprefix('ratio_')} {value:.2f}x"
            for key, value in values.items()
            if key.startswith("ratio")
        )
        print(f"  {name:30s} {cells}  {ratios}".rstrip())


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer calls and repeats (noisier)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument(
        "--compare",
        type=Path,
        metavar="CHECKOUT",
        help="only the per-call table, of this checkout and of CHECKOUT in alternating processes",
    )
    parser.add_argument("--rounds", type=int, default=4, help="processes per checkout (--compare)")
    args = parser.parse_args(argv)
    if args.compare is not None:
        results = compare_checkouts(args.compare, args.rounds)
        for name, rows in results.items():
            loads = ", ".join(f"{load:.1f}" for load in rows.pop("load_averages"))
            _print_rows(
                f"{name} ({args.compare if name == 'other' else ROOT}), load {loads}", rows, "us", 1
            )
        if args.json:
            args.json.write_text(json.dumps(results, indent=2))
        return results
    scale = 1 if args.quick else 4

    import torch

    print(
        f"torch {torch.__version__}, torch threads {torch.get_num_threads()}, "
        f"{os.cpu_count()} cpus, load average {os.getloadavg()[0]:.1f}"
    )
    results: dict[str, Any] = {"load_average_start": os.getloadavg()[0]}
    results["per_call"] = bench_per_call(calls=250 * scale, rounds=4)
    _print_rows(f"Per call, {SHAPE} f32 RMSNorm", results["per_call"], "us", 1)

    results["llama_forward"] = llama = bench_llama(calls=15 * scale, rounds=4)
    print(f"\nTiny Llama forward, batch 1, 16 tokens ({llama['rmsnorm_layers']} RMSNorm layers)")
    for key, times in llama.items():
        if key.startswith("torch threads"):
            rows = {f"{name}, {key}": times[name] for name in ("stock", "kernelized")}
            _print_rows("", rows, "us", 1)
            print(
                f"  kernelized / stock: {times['ratio_median']:.2f}x (median), "
                f"{times['ratio_min']:.2f}x (min)"
            )
    print(f"  max |logit difference| {llama['max_abs_logit_diff']:.1e}")

    results["generate_compiles"] = _child("--generate", {"KERNEL_HUB_COMPILATION_CACHE": "0"})
    print("\nCompilations during generate(64 new tokens), fresh process, kernelized tiny Llama")
    for name, row in results["generate_compiles"].items():
        print(
            f"  {name:17s} {row['new_tokens']} tokens, {row['distinct_row_counts']} distinct "
            f"RMSNorm row counts: {row['bridge_compilations']} bridge executables, "
            f"{row['xla_backend_compiles']} XLA backend compiles"
        )

    results["first_call"] = bench_first_call(repeats=1 if args.quick else 3)
    _print_rows("First bridged call in a fresh process (median)", results["first_call"], "ms", 1e3)
    results["thread_policies"] = bench_thread_policies()
    _print_rows("Bridged per-call time by thread policy", results["thread_policies"], "us", 1)
    results["load_average_end"] = os.getloadavg()[0]
    print(f"\nload average at the end {results['load_average_end']:.1f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return results


_CHILDREN = {
    "--first-call": first_call_child,
    "--per-call": per_call_child,
    "--per-call-table": per_call_table_child,
    "--generate": generate_child,
}

if __name__ == "__main__":
    child = _CHILDREN.get(sys.argv[1]) if len(sys.argv) > 1 else None
    if child is not None:
        child()
    else:
        main()
