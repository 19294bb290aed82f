"""MoE layer decode and prefill on TPU, modelled without a TPU: deviceless compiles of the stock
XLA experts path and of kernel-hub's fused kernel (bf16, int8, fp8, w8a8, mxfp4), with the bytes
each compiled program reads and the roofline time that implies.

For Mixtral-8x7B, Qwen3-30B-A3B, GPT-OSS-120B and DeepSeek-V3 layer sizes (experts only: the
router and shared experts are outside), at decode T = 1, 16, 64, 256, 512 and prefill 8192, for
v5e and v6e, each path is traced, lowered and compiled for the generation's deviceless topology.
Recorded per cell: XLA's cost analysis (FLOPs and bytes accessed; a Pallas kernel contributes
its declared cost estimate), the compiled program's argument and temporary HBM bytes, the
compile time or the compiler's error, and a hand count of the expert-weight bytes a step must
read (the experts tokens are expected to touch under uniform top-k routing).

Paths:
* ``stock-batched_mm``: Transformers' ``batched_mm`` experts as XLA compiles them (each
  (token, slot) row gathers its expert's weights, ``[T*k, 2I, H]``, then batched matmuls);
* ``xla-ragged_dot``: rows sorted and copied, two ``ragged_dot``s (what ``grouped_mm`` computes;
  kernel-hub's XLA implementation);
* ``fused-bf16`` / ``fused-int8`` / ``fused-fp8`` / ``fused-w8a8`` / ``fused-mxfp4`` (GPT-OSS only):
  kernel-hub's fused Pallas kernel on the weights as the Transformers integration prepares them
  (padded once to whole lanes: GPT-OSS bf16 H 2944, mxfp4 H = I = 3072; ``fused_moe.padding``).

This is a model of TPU time: ``time = max(FLOPs / peak, bytes / HBM bandwidth)`` from the roofline
table (kernel_hub.bench.roofline). On hardware the bytes would stand (they are what the program
reads) but the time would not: grid-step overheads, DMA efficiency and the one-hot gather/scatter
matmuls of the fused kernel are not in it.

    python benchmarks/moe_decode.py [--tpu v5e,v6e] [--models ...] [--tokens 1,16,64,256,512,8192]
        [--paths ...] --json benchmarks/moe_decode.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding

from kernel_hub import get_kernel
from kernel_hub.bench.roofline import chip
from kernel_hub.topologies import filtered_libtpu_stderr, tpu_device

fused = get_kernel("fused-moe")
bench = fused.benchmark
quant = fused.quant
PATHS = ("stock-batched_mm", "xla-ragged_dot", "fused-bf16", "fused-int8", "fused-fp8",
         "fused-w8a8", "fused-mxfp4")  # fmt: skip
QUANTIZATION = {"fused-int8": "int8", "fused-fp8": "fp8", "fused-w8a8": "w8a8",
                "fused-mxfp4": "mxfp4"}  # fmt: skip


def expected_experts(model, tokens: int) -> float:
    """Distinct experts touched when each token picks top_k of E uniformly at random."""
    e, k = model.experts, model.top_k
    return e * (1 - (1 - k / e) ** tokens)


def hand_weight_bytes(model, tokens: int, quantization: str | None) -> float:
    """Expected weight (and scale) bytes of the experts a step touches, unpadded."""
    one = model._replace(experts=1, top_k=1, transposed=model.transposed and not quantization)
    return expected_experts(model, tokens) * bench.weight_bytes(one, 1, quantization, jnp.bfloat16)


def stock_batched_mm(x, ids, weights, w1, w2, b1, b2, *, model):
    """Transformers' batched_mm_experts_forward, op for op, in JAX."""
    tokens, top_k = ids.shape
    rows = jnp.repeat(x, top_k, axis=0)
    flat = ids.reshape(-1)
    spec = "sh,sho->so" if model.transposed else "sh,soh->so"
    h = jnp.einsum(spec, rows, w1[flat])
    if b1 is not None:
        h = h + b1[flat]
    gate, up = (h[:, 0::2], h[:, 1::2]) if model.interleaved else jnp.split(h, 2, axis=-1)
    act = fused.jax.Activation(model.activation)(gate, up).astype(x.dtype)
    spec = "si,sih->sh" if model.transposed else "si,shi->sh"
    y = jnp.einsum(spec, act, w2[flat])
    if b2 is not None:
        y = y + b2[flat]
    y = y * weights.reshape(-1, 1)
    return y.reshape(tokens, top_k, -1).sum(1).astype(x.dtype)


def _path_fn(path: str, model):
    kwargs = dict(activation=model.activation, transposed=model.transposed,
                  interleaved=model.interleaved)  # fmt: skip
    if path == "stock-batched_mm":
        return lambda x, i, w, w1, w2, b1, b2, *s: stock_batched_mm(x, i, w, w1, w2, b1, b2,
                                                                    model=model)  # fmt: skip
    quantization = QUANTIZATION.get(path)
    implementation = "xla" if path == "xla-ragged_dot" else "pallas"
    return functools.partial(fused.jax.fused_experts, quantization=quantization,
                             implementation=implementation, **kwargs)  # fmt: skip


def compile_cell(path: str, model, tokens: int, generation: str) -> dict[str, Any]:
    quantization = QUANTIZATION.get(path)
    cell: dict[str, Any] = {"model": model.name, "tokens": tokens, "path": path,
                            "tpu": generation}  # fmt: skip
    if (quantization == "mxfp4") != (model.activation == "gpt_oss" and quantization is not None):
        cell["error"] = (
            "not offered: quantize_experts makes GPT-OSS's MXFP4 (int8/fp8/w8a8 use [E, out, in] "
            "weights) and MXFP4 is GPT-OSS's format"
        )
        return cell
    if path.startswith("fused"):  # as the Transformers integration pads the weights once
        model = bench.prepared(model, quantization)
    case = bench.case(model, tokens, quantization)
    device = tpu_device(generation)
    sharding = SingleDeviceSharding(device)
    args = [None if a is None else jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)
            for a in case.args]  # fmt: skip
    start = time.perf_counter()
    try:
        with filtered_libtpu_stderr(), jax.default_device(device):
            compiled = jax.jit(_path_fn(path, model)).trace(*args).lower().compile()
    except Exception as exc:  # the compiler's message is the result
        cell["error"] = f"{type(exc).__name__}: {exc}".strip()[:600]
        cell["compile_s"] = round(time.perf_counter() - start, 2)
        return cell
    cost = compiled.cost_analysis() or {}
    cost = cost[0] if isinstance(cost, list) else cost
    memory = compiled.memory_analysis()
    roof = chip(generation)
    flops, read = float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))
    hand = hand_weight_bytes(model, tokens, quantization if path.startswith("fused") else None)
    cell.update(
        kernel_shape=[model.hidden, model.intermediate],
        compile_s=round(time.perf_counter() - start, 2),
        flops=flops,
        bytes_accessed=read,
        argument_bytes=int(memory.argument_size_in_bytes),
        temp_bytes=int(memory.temp_size_in_bytes),
        hand_weight_bytes=hand,
        model_time_us=roof.time_floor(flops, read) * 1e6,
        hand_time_us=roof.time_floor(case.flops, hand) * 1e6,
    )
    return cell


def stock_weight_bytes(model, tokens: int) -> float:
    """Hand count for batched_mm: every (token, slot) row gathers its expert's weights."""
    return tokens * model.top_k * 3 * model.intermediate * model.hidden * 2


def _row(cells: list[dict], model, tokens: int, generation: str) -> list[str]:
    roof = chip(generation)
    found = {c["path"]: c for c in cells if c["model"] == model.name and c["tokens"] == tokens
             and c["tpu"] == generation}  # fmt: skip
    flops = 2 * tokens * model.top_k * 3 * model.intermediate * model.hidden
    stock = stock_weight_bytes(model, tokens)
    out = [
        model.name,
        str(tokens),
        f"{stock / 1e9:.2f} / {roof.time_floor(flops, stock) * 1e6:.0f}",
    ]
    for path in PATHS[1:]:
        cell = found.get(path)
        if cell is None:
            out.append("-")
        elif "error" in cell:
            if "memory on HBM" in cell["error"]:
                out.append("does not fit HBM")
            elif "prefill runs the sorted ragged_dot path" in cell["error"]:
                out.append("(XLA path)")
            else:
                out.append("n/a")
        else:
            read = cell["bytes_accessed"]
            out.append(f"{read / 1e9:.2f} / {roof.time_floor(cell['flops'], read) * 1e6:.0f}")
    hand = hand_weight_bytes(model, tokens, None)
    out.append(f"{hand / 1e9:.2f}")
    return out


def report(path: str, plot: str | None) -> str:
    """Markdown tables (one per generation) and an optional plot of modelled time vs tokens."""
    with open(path) as f:
        data = json.load(f)
    cells = data["cells"]
    header = ["model", "T", "stock batched_mm (hand)", "XLA ragged_dot", "fused bf16",
              "fused int8", "fused fp8", "fused w8a8", "fused mxfp4",
              "hand count bf16 weights"]  # fmt: skip
    lines = ["Reproduce (in this order):", ""]
    lines += [f"    {command}" for command in data["commands"]]
    lines += [
        "",
        "then `python benchmarks/moe_decode.py --report --json <that file> --plot <png>`.",
        "",
    ]
    for generation in sorted({c["tpu"] for c in cells}, reverse=True):
        roof = chip(generation)
        lines += [
            f"### {generation}: GB read per step / modelled time (us)",
            "",
            f"Roofline: {roof.peak_flops / 1e12:.0f} TFLOP/s bf16, "
            f"{roof.memory_bandwidth / 1e9:.0f} GB/s HBM.",
            "",
            "| " + " | ".join(header) + " |",
            "|" + "---|" * len(header),
        ]
        for model in bench.MODELS:
            for tokens in sorted({c["tokens"] for c in cells if c["tpu"] == generation}):
                lines.append("| " + " | ".join(_row(cells, model, tokens, generation)) + " |")
        lines.append("")
    stock = [c for c in cells if c["path"] == "stock-batched_mm" and "error" not in c]
    if stock:
        lines += ["Stock batched_mm compiled (cross-check of the hand count):", ""]
        for c in stock:
            model = next(m for m in bench.MODELS if m.name == c["model"])
            lines.append(
                f"- {c['tpu']} {c['model']} T={c['tokens']}: cost analysis "
                f"{c['bytes_accessed'] / 1e9:.2f} GB, temporaries {c['temp_bytes'] / 1e9:.2f} GB; "
                f"hand count {stock_weight_bytes(model, c['tokens']) / 1e9:.2f} GB"
            )
    if plot:
        _plot(cells, plot)
    return "\n".join(lines)


def _plot(cells: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    generation = "v6e"
    roof = chip(generation)
    fig, axes = plt.subplots(1, len(bench.MODELS), figsize=(4 * len(bench.MODELS), 3.6))
    for ax, model in zip(axes, bench.MODELS, strict=True):
        mine = [c for c in cells if c["model"] == model.name and c["tpu"] == generation
                and c["tokens"] <= 512]  # fmt: skip
        tokens = sorted({c["tokens"] for c in mine})
        ax.set_title(model.name)
        if not tokens:
            continue
        flops = [2 * t * model.top_k * 3 * model.intermediate * model.hidden for t in tokens]
        stock = [roof.time_floor(f, stock_weight_bytes(model, t)) * 1e6
                 for f, t in zip(flops, tokens, strict=True)]  # fmt: skip
        ax.plot(tokens, stock, "k--", label="stock batched_mm (hand)")
        for color, name in enumerate(PATHS[1:], start=1):
            points = [(c["tokens"], roof.time_floor(c["flops"], c["bytes_accessed"]) * 1e6)
                      for c in mine if c["path"] == name and "error" not in c]  # fmt: skip
            if points:
                ax.plot(
                    *zip(*sorted(points), strict=True), marker="o", label=name, color=f"C{color}"
                )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens per decode step")
    axes[0].set_ylabel(f"modelled {generation} time per layer (us)")
    handles = {
        label: h for ax in axes for h, label in zip(*ax.get_legend_handles_labels(), strict=True)
    }
    axes[0].legend(handles.values(), handles.keys(), fontsize=7)
    fig.suptitle("MoE experts, modelled TPU time (deviceless compile + roofline), not measured")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tpu", default="v5e,v6e")
    parser.add_argument("--models", default=",".join(m.name for m in bench.MODELS))
    parser.add_argument("--tokens", default="1,16,64,256,512,8192")
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument(
        "--stock-tokens",
        default="1",
        help="token counts at which stock-batched_mm is compiled (its compiles take minutes; "
        "the report hand-counts the others)",
    )
    parser.add_argument("--json", required=True)
    parser.add_argument("--report", action="store_true", help="print tables from --json")
    parser.add_argument("--plot", help="with --report: write a plot here")
    parser.add_argument("--append", action="store_true", help="add to the cells in --json")
    args = parser.parse_args(argv)
    if args.report:
        print(report(args.json, args.plot))
        return 0
    models = {m.name: m for m in bench.MODELS}
    stock_tokens = {int(t) for t in args.stock_tokens.split(",")}
    cells, commands = [], []
    if args.append and os.path.exists(args.json):
        with open(args.json) as existing:
            previous = json.load(existing)
        cells, commands = previous["cells"], previous["commands"]
    commands.append(" ".join(["python benchmarks/moe_decode.py", *(argv or sys.argv[1:])]))
    for generation in args.tpu.split(","):
        for name in args.models.split(","):
            for tokens in (int(t) for t in args.tokens.split(",")):
                for path in args.paths.split(","):
                    if path == "stock-batched_mm" and tokens not in stock_tokens:
                        continue
                    cell = compile_cell(path, models[name], tokens, generation)
                    cells.append(cell)
                    status = cell.get("error", "")[:90] or (
                        f"{cell['bytes_accessed'] / 1e9:8.3f} GB  {cell['model_time_us']:9.1f} us"
                    )
                    print(f"{generation} {name:15s} T={tokens:5d} {path:17s} {status}", flush=True)
                    with open(args.json, "w") as out:
                        json.dump({"commands": commands, "cells": cells}, out, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
