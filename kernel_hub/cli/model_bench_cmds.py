"""``kernel-hub model-bench``: a whole model compiled stock and kernelized for a TPU."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from kernel_hub.errors import KernelHubError
from kernel_hub.models.decode_bench import KV_CACHE_DTYPES
from kernel_hub.models.quantized_bench import WEIGHTS

from .output import print_table


def _setting(text: str) -> tuple[str, Any]:
    """'k=v' -> (k, v), v read as JSON when it parses (numbers, booleans, lists), else a string."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "model-bench",
        help="a whole model stock vs kernelized on a TPU (deviceless compile; timed on a TPU)",
        description="Build a model at real width with a few decoder layers (no weights), stock "
        "and kernelized, trace each to one JAX program as torchax runs it, compile it for a TPU "
        "generation without a TPU, and report peak HBM, bytes, FLOPs and a roofline time scaled "
        "to the full depth, with the kernels in each program. On a TPU of that generation the "
        "programs are also timed. See docs/model-bench.md.",
    )
    parser.add_argument("preset", nargs="?", metavar="PRESET", help="a model preset name")
    parser.add_argument("--config", metavar="JSON", help="a Transformers config.json instead")
    parser.add_argument("--model-type", help="a Transformers model type's default config instead")
    parser.add_argument(
        "--set",
        type=_setting,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field (repeatable)",
    )
    parser.add_argument(
        "--mode",
        choices=("train", "prefill", "decode", "denoise"),
        required=True,
        help="a causal LM's training step, prefill or decode step; a Diffusers transformer's "
        "denoising step (denoise)",
    )
    parser.add_argument(
        "--image",
        type=int,
        default=1024,
        help="denoise: the image's side in pixels (default 1024)",
    )
    parser.add_argument(
        "--seq", type=int, default=4096, help="train/prefill: tokens per sequence (default 4096)"
    )
    parser.add_argument("--batch", type=int, default=1, help="sequences (default 1)")
    parser.add_argument(
        "--context",
        type=int,
        default=4096,
        help="decode: tokens per sequence in the KV cache, the new one included (default 4096)",
    )
    parser.add_argument(
        "--cache",
        choices=("paged", "static"),
        default="paged",
        help="decode: continuous batching's paged cache (generate_batch) or Transformers' "
        "StaticCache (default paged)",
    )
    parser.add_argument(
        "--weights",
        choices=WEIGHTS,
        default="bf16",
        help="decode: the kernelized variant's linear layers held quantized (QuantizedLinear on "
        "the quantized-matmul kernel, as quantize_linear keeps them); stock holds the "
        "dequantized bf16 weights (default bf16)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="bfloat16",
        help="decode with --cache paged: the kernelized variant's KV cache, 8-bit with one f32 "
        "scale per token and kv head; stock keeps bf16 (default bfloat16)",
    )
    parser.add_argument(
        "--layers",
        type=int,
        default=2,
        help="decoder layers compiled per layer type (default 2; then scaled)",
    )
    parser.add_argument("--tpu", choices=("v5e", "v6e"), required=True)
    parser.add_argument(
        "--topology",
        metavar="GRID",
        help="shard the step over a multi-chip grid of the generation (2x2, 4x4): Transformers' "
        "tensor-parallel plan over --tp chips, FSDP over the rest; figures per chip "
        "(default: one chip)",
    )
    parser.add_argument(
        "--tp",
        type=int,
        help="with --topology: chips on the tensor-parallel axis (default: all; 1: FSDP alone, "
        "the model's TP plan not read)",
    )
    parser.add_argument(
        "--figure-cache",
        metavar="DIR",
        help="where compiled programs' figures are kept across runs, so an unchanged program "
        "is not compiled again; 'off' compiles every program (default: "
        "$KERNEL_HUB_FIGURE_CACHE_DIR, else ~/.cache/kernel-hub/model-bench)",
    )
    parser.add_argument("--json", metavar="PATH", help="write one object per variant")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG: stock vs kernelized bars")
    parser.set_defaults(func=run_model_bench_command)


def _spec(args: argparse.Namespace) -> Any:
    from kernel_hub.models import model_bench

    sources = [s for s in (args.preset, args.config, args.model_type) if s]
    if len(sources) != 1:
        raise KernelHubError("give exactly one of PRESET, --config JSON or --model-type TYPE")
    shape = {
        "mode": args.mode,
        "tpu": args.tpu,
        "seq": args.seq,
        "batch": args.batch,
        "context": args.context,
        "cache": args.cache,
        "layers": args.layers,
        "topology": args.topology,
        "tp": args.tp,
        "image": args.image,
        "weights": args.weights,
        "kv_cache_dtype": args.kv_cache_dtype,
        "overrides": dict(args.set),
    }
    if args.preset:
        return model_bench.spec_for_preset(args.preset, **shape)
    if args.config:
        return model_bench.spec_for_config_file(args.config, **shape)
    return model_bench.spec_for_model_type(args.model_type, **shape)


def _figure_cache(option: str | None) -> Path | None:
    from kernel_hub.bench.figure_cache import default_cache_dir

    if option is None:
        return default_cache_dir()
    return None if option == "off" else Path(option).expanduser()


def run_model_bench_command(args: argparse.Namespace) -> int:
    from kernel_hub.bench.model_figures import MODEL_BENCH_HEADERS, model_bench_row

    if args.plot:
        import matplotlib  # noqa: F401  (missing: the CLI names the extra, before any compile)
    spec = _spec(args)
    from kernel_hub.models.model_bench import run_model_bench

    results = run_model_bench(spec, _figure_cache(args.figure_cache))
    print_table(MODEL_BENCH_HEADERS, [model_bench_row(r) for r in results])
    for result in results:
        print(f"\n{result.variant}:")
        for target, op in result.replaced.items():
            print(f"  replaced {target} -> {op}")
        for note in result.notes:
            print(f"  note: {note}")
    if args.json:
        Path(args.json).write_text(json.dumps([r.to_json() for r in results], indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.plot:
        from kernel_hub.bench.plot import save_model_bench_plot

        save_model_bench_plot([r.to_json() for r in results], args.plot)
        print(f"wrote {args.plot}")
    return 0
