"""Kernels against the XLA programs they replace, from deviceless TPU compiles.

Reproduces docs/kernel-vs-xla.md. For each TPU generation, each program is compiled without a TPU
and read back:
temporaries (``memory_analysis().temp_size_in_bytes``), FLOPs and bytes accessed
(``cost_analysis()``), and the roofline time ``max(FLOPs / peak, bytes / HBM bandwidth)`` with
``kernel_hub.bench.roofline``'s chip figures. A Pallas call adds only its declared
``pl.CostEstimate`` to ``cost_analysis()``; linear-cross-entropy's is the hand count of its block
schedule (tested against ``kernel_hub.bench.block_schedule``), attention's is its own estimate.

* linear cross-entropy, Qwen3-8B head (H 4096, V 151936, bf16), 32,768 tokens,
  ``jax.value_and_grad`` in (hidden, weight): the kernel; optax's
  ``softmax_cross_entropy_with_integer_labels`` on f32 logits; Transformers' stock loss (bf16
  logits, f32 log-softmax).
* attention, Llama-3-8B heads (32 q / 8 kv, D 128, bf16, causal), batch 2 x 8192, forward and
  forward + backward: the kernel; ``jax.nn.dot_product_attention`` (XLA). And Flux's joint
  attention at 1024 x 1024 px (24 heads of 128, 4,608 tokens, no mask, bf16): the kernel forward
  and forward + backward; ``jax.nn.dot_product_attention``'s XLA forward.
* causal conv1d, Qwen3-Next-80B-A3B's short convolution (8192 channels, width 4, SiLU, no bias,
  bf16), one 8192-token sequence, forward + backward in (x, weight) with the gradient from
  above an argument: the Pallas kernel; its XLA implementation.
* gated RMSNorm, Qwen3-Next's mixer norm (8192 tokens x 32 value heads = 262,144 rows of 128,
  bf16 x and gate, f32 weight, norm before gate), forward + backward in (x, gate, weight) with
  the gradient from above an argument: the Pallas kernel; its XLA implementation.
* Mamba-2 scan, Mamba-2 2.7B's layer (80 heads of 64, one group, state 128, chunk 256, bf16,
  dt softplus, D and dt_bias), one 8192-token sequence, forward + backward in (x, dt, A, B, C,
  D, dt_bias) with the gradients from above (y and the final state) arguments: the Pallas
  kernel; its XLA implementation (the chunked form).
* gated delta rule, Qwen3-Next-80B-A3B's linear-attention layer (16 q/k heads, 32 value heads,
  head dims 128, bf16 q/k/v, q/k L2 norm in the op), one 8192-token sequence, forward + backward
  in (q, k, v, g, beta, initial state) with the gradients from above (o and the final state)
  arguments: the Pallas kernel; its XLA implementation (the chunked form).

When XLA refuses a program because its temporaries exceed the chip's HBM, the figure it reports
is recorded instead. Compiler figures for a deviceless topology: a model of the TPU, not a
measurement on one. Each compile runs once (minutes on a small machine):

    PYTHONPATH=$PWD python benchmarks/kernel_vs_xla.py [--generations v5e v6e] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from typing import Any

TOKENS, HIDDEN, VOCAB = 32768, 4096, 151936
BATCH, LENGTH, Q_HEADS, KV_HEADS, HEAD_DIM = 2, 8192, 32, 8, 128
FLUX_TOKENS, FLUX_HEADS = 4608, 24
CONV_LENGTH, CONV_CHANNELS, CONV_WIDTH = 8192, 8192, 4
NORM_ROWS, NORM_HIDDEN = 8192 * 32, 128
SCAN_LENGTH, SCAN_HEADS, SCAN_HEAD_DIM, SCAN_STATE = 8192, 80, 64, 128
DELTA_LENGTH, DELTA_KEY_HEADS, DELTA_HEADS, DELTA_DIM = 8192, 16, 32, 128
_TOO_BIG = re.compile(r"required for HLO temporaries \(([\d.]+)([MG])\)")


def _programs() -> dict[str, tuple[Callable[..., Any], tuple, tuple[int, ...]]]:
    """name -> (function, abstract arguments, differentiated argument numbers or ())."""
    import jax
    import jax.numpy as jnp
    import optax

    from kernel_hub import get_kernel

    lce = get_kernel("linear-cross-entropy").KERNEL.jax
    attention = get_kernel("attention").KERNEL.jax
    conv = get_kernel("causal-conv1d").KERNEL.jax
    norm = get_kernel("rmsnorm").KERNEL.jax
    scan = get_kernel("mamba2-scan").KERNEL.jax
    delta = get_kernel("gated-delta-rule").KERNEL.jax
    struct = jax.ShapeDtypeStruct
    head = (
        struct((TOKENS, HIDDEN), jnp.bfloat16),
        struct((VOCAB, HIDDEN), jnp.bfloat16),
        struct((TOKENS,), jnp.int32),
    )

    def kernel_loss(h, w, labels):
        return lce.linear_cross_entropy(h, w, labels, implementation="pallas")

    def optax_loss(h, w, labels):
        logits = jnp.dot(h, w.T, preferred_element_type=jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    def stock_loss(h, w, labels):
        logits = jnp.dot(h, w.T).astype(jnp.float32)
        log_probs = jax.nn.log_softmax(logits, axis=-1)
        counted = labels != -100
        picked = jnp.take_along_axis(log_probs, jnp.maximum(labels, 0)[:, None], axis=-1)[:, 0]
        return -jnp.sum(jnp.where(counted, picked, 0.0)) / jnp.sum(counted)

    qkv = (
        struct((BATCH, Q_HEADS, LENGTH, HEAD_DIM), jnp.bfloat16),
        struct((BATCH, KV_HEADS, LENGTH, HEAD_DIM), jnp.bfloat16),
        struct((BATCH, KV_HEADS, LENGTH, HEAD_DIM), jnp.bfloat16),
    )

    def kernel_attention(q, k, v):
        return attention.dot_product_attention(q, k, v, causal=True, implementation="pallas")

    def xla_attention(q, k, v):  # jax.nn's layout is [B, S, H, D]
        out = jax.nn.dot_product_attention(
            *(x.swapaxes(1, 2) for x in (q, k, v)), is_causal=True, implementation="xla"
        )
        return out.swapaxes(1, 2)

    flux_qkv = (struct((1, FLUX_HEADS, FLUX_TOKENS, HEAD_DIM), jnp.bfloat16),) * 3

    def kernel_joint_attention(q, k, v):
        return attention.dot_product_attention(q, k, v, implementation="pallas")

    def xla_joint_attention(q, k, v):
        swapped = (x.swapaxes(1, 2) for x in (q, k, v))
        out = jax.nn.dot_product_attention(*swapped, implementation="xla")
        return out.swapaxes(1, 2)

    # The last argument of the conv and norm programs is the gradient arriving from above (the
    # output times it is summed): a step's dy is an array, not the constant a plain sum gives.
    conv_tokens = struct((1, CONV_LENGTH, CONV_CHANNELS), jnp.bfloat16)
    conv_args = (conv_tokens, struct((CONV_CHANNELS, CONV_WIDTH), jnp.bfloat16), conv_tokens)

    def conv_with(implementation: str):
        def run(x, weight, upstream):
            y = conv.causal_conv1d(x, weight, activation="silu", implementation=implementation)
            return y * upstream

        return run

    norm_rows = struct((NORM_ROWS, NORM_HIDDEN), jnp.bfloat16)
    norm_args = (norm_rows, norm_rows, struct((NORM_HIDDEN,), jnp.float32), norm_rows)

    def norm_with(implementation: str):
        def run(x, gate, weight, upstream):
            y = norm.gated_rms_norm(x, gate, weight, 1e-6, implementation=implementation)
            return y * upstream

        return run

    heads = struct((SCAN_HEADS,), jnp.float32)
    scan_y = struct((1, SCAN_LENGTH, SCAN_HEADS, SCAN_HEAD_DIM), jnp.float32)
    scan_args = (
        struct((1, SCAN_LENGTH, SCAN_HEADS, SCAN_HEAD_DIM), jnp.bfloat16),
        struct((1, SCAN_LENGTH, SCAN_HEADS), jnp.bfloat16),
        heads,
        struct((1, SCAN_LENGTH, 1, SCAN_STATE), jnp.bfloat16),
        struct((1, SCAN_LENGTH, 1, SCAN_STATE), jnp.bfloat16),
        heads,
        heads,
        scan_y,
        struct((1, SCAN_HEADS, SCAN_HEAD_DIM, SCAN_STATE), jnp.float32),
    )

    def scan_with(implementation: str):
        def run(x, dt, A, B, C, D, dt_bias, upstream, upstream_final):
            y, final = scan.mamba_chunk_scan_combined(
                x, dt, A, B, C, D, dt_bias, dt_softplus=True, implementation=implementation
            )
            return jnp.sum(y * upstream) + jnp.sum(final * upstream_final)

        return run

    delta_qk = struct((1, DELTA_LENGTH, DELTA_KEY_HEADS, DELTA_DIM), jnp.bfloat16)
    delta_v = struct((1, DELTA_LENGTH, DELTA_HEADS, DELTA_DIM), jnp.bfloat16)
    delta_gates = struct((1, DELTA_LENGTH, DELTA_HEADS), jnp.float32)
    delta_state = struct((1, DELTA_HEADS, DELTA_DIM, DELTA_DIM), jnp.float32)
    delta_args = (delta_qk, delta_qk, delta_v, delta_gates, delta_gates, delta_state)
    delta_args += (delta_v, delta_state)

    def delta_with(implementation: str):
        def run(q, k, v, g, beta, state, upstream, upstream_final):
            out, final = delta.chunk_gated_delta_rule(
                q, k, v, g, beta, state, use_qk_l2norm=True, implementation=implementation
            )
            return jnp.sum(out * upstream) + jnp.sum(final * upstream_final)

        return run

    return {
        "linear-cross-entropy kernel": (kernel_loss, head, (0, 1)),
        "linear-cross-entropy optax (f32 logits)": (optax_loss, head, (0, 1)),
        "linear-cross-entropy stock": (stock_loss, head, (0, 1)),
        "attention kernel, forward": (kernel_attention, qkv, ()),
        "attention XLA, forward": (xla_attention, qkv, ()),
        "attention kernel, fwd+bwd": (kernel_attention, qkv, (0, 1, 2)),
        "attention XLA, fwd+bwd": (xla_attention, qkv, (0, 1, 2)),
        "attention kernel, Flux forward": (kernel_joint_attention, flux_qkv, ()),
        "attention XLA, Flux forward": (xla_joint_attention, flux_qkv, ()),
        "attention kernel, Flux fwd+bwd": (kernel_joint_attention, flux_qkv, (0, 1, 2)),
        "causal-conv1d kernel, fwd+bwd": (conv_with("pallas"), conv_args, (0, 1)),
        "causal-conv1d XLA, fwd+bwd": (conv_with("xla"), conv_args, (0, 1)),
        "gated RMSNorm kernel, fwd+bwd": (norm_with("pallas"), norm_args, (0, 1, 2)),
        "gated RMSNorm XLA, fwd+bwd": (norm_with("xla"), norm_args, (0, 1, 2)),
        "Mamba-2 scan kernel, fwd+bwd": (scan_with("pallas"), scan_args, tuple(range(7))),
        "Mamba-2 scan XLA, fwd+bwd": (scan_with("xla"), scan_args, tuple(range(7))),
        "gated-delta-rule kernel, fwd+bwd": (delta_with("pallas"), delta_args, tuple(range(6))),
        "gated-delta-rule XLA, fwd+bwd": (delta_with("xla"), delta_args, tuple(range(6))),
    }


def _step(fn, differentiated: tuple[int, ...]):
    import jax
    import jax.numpy as jnp

    if not differentiated:
        return fn
    return jax.value_and_grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32)), differentiated)


def measure(fn, args: tuple, differentiated: tuple[int, ...], generation: str) -> dict[str, Any]:
    import jax
    from jax.sharding import SingleDeviceSharding

    from kernel_hub.bench.compile_check import no_persistent_cache
    from kernel_hub.bench.roofline import chip
    from kernel_hub.topologies import filtered_libtpu_stderr, tpu_device

    device = tpu_device(generation)
    placed = tuple(
        jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=SingleDeviceSharding(device)) for a in args
    )
    try:
        with filtered_libtpu_stderr(), no_persistent_cache(), jax.default_device(device):
            compiled = jax.jit(_step(fn, differentiated)).trace(*placed).lower().compile()
    except Exception as exc:  # a refused compile is a result
        too_big = _TOO_BIG.search(str(exc))
        if too_big is None:
            return {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        scale = 2**30 if too_big.group(2) == "G" else 2**20
        return {"temp_bytes_required": float(too_big.group(1)) * scale, "error": "exceeds HBM"}
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    flops, accessed = float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))
    return {
        "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
        "flops": flops,
        "bytes_accessed": accessed,
        "roofline_s": chip(generation).time_floor(flops, accessed),
    }


def _line(generation: str, name: str, row: dict[str, Any]) -> str:
    if "temp_bytes" not in row:
        required = row.get("temp_bytes_required")
        need = f"needs {required / 2**20:,.0f} MiB" if required else row["error"]
        return f"| {generation} | {name} | {need} (not compiled) | - | - | - |"
    return (
        f"| {generation} | {name} | {row['temp_bytes'] / 2**20:,.1f} | {row['flops'] / 1e9:,.0f} "
        f"| {row['bytes_accessed'] / 1e9:,.1f} | {row['roofline_s'] * 1e3:,.2f} |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--generations", nargs="+", default=["v5e", "v6e"])
    parser.add_argument("--only", help="run the programs whose name contains this")
    parser.add_argument("--json", help="write the rows here")
    options = parser.parse_args(argv)
    sys.argv = sys.argv[:1]
    print("| TPU | program | temporaries MiB | GFLOP | GB accessed | roofline ms |")
    print("|---|---|---|---|---|---|")
    rows = []
    for generation in options.generations:
        for name, (fn, args, differentiated) in _programs().items():
            if options.only and options.only not in name:
                continue
            row = measure(fn, args, differentiated, generation)
            rows.append({"generation": generation, "program": name, **row})
            print(_line(generation, name, row), flush=True)
    if options.json:
        with open(options.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
