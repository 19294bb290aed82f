"""Deviceless decode-step bytes of Llama-3-8B's linear layers: bf16 weights (XLA's dot) against
fp8, int8 and int4 weights (the quantized-matmul Pallas kernels), per TPU generation and batch,
beside the hand-count bound (activations, weights with their scales and outputs, each read or
written once).

    PYTHONPATH=. python scripts/quantized_matmul_bytes.py [v5e v6e]

What the figures are: XLA's ``cost_analysis()`` of each compiled projection. For XLA's own dot
that is XLA's estimate of the fused program's traffic; for a Pallas kernel it is only the kernel's
declared ``CostEstimate``, i.e. a hand count of its block schedule (x re-fetched per output block
when the contraction is split, the weight per row block), not a measurement. Neither says how
close a TPU comes to its HBM bandwidth; a run on a TPU does.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding

from kernel_hub import get_kernel
from kernel_hub.bench.compile_check import filtered_libtpu_stderr, no_persistent_cache
from kernel_hub.topologies import tpu_device

LAYERS = 32
# one decoder layer's projections, (out, in), and the LM head once
PROJECTIONS = {
    "q_proj": (4096, 4096),
    "k_proj": (1024, 4096),
    "v_proj": (1024, 4096),
    "o_proj": (4096, 4096),
    "gate_proj": (14336, 4096),
    "up_proj": (14336, 4096),
    "down_proj": (4096, 14336),
}
BATCHES = (1, 16, 64, 256)


def compiled_bytes(fn, args, device) -> float:
    """XLA's cost_analysis() bytes of ``fn`` compiled for ``device`` (deviceless)."""
    placed = [
        None
        if a is None
        else jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=SingleDeviceSharding(device))
        for a in args
    ]  # None: an optional argument left out
    with jax.default_device(device):
        compiled = jax.jit(fn).trace(*placed).lower().compile()
    cost = compiled.cost_analysis()
    return float((cost[0] if isinstance(cost, list) else cost)["bytes accessed"])


def _quantized(fmt: str, out: int, inner: int):
    """(weight, scale) shapes of an [out, in] layer in ``fmt``, and the op that reads them."""
    qmm = get_kernel("quantized-matmul")
    struct = jax.ShapeDtypeStruct
    if fmt == "int4":
        args = struct((inner // 8, out), jnp.int32), struct((inner // 128, out), jnp.float32)
        return args, qmm.jax.quantized_matmul_int4
    if fmt == "int8":
        args = struct((out, inner), jnp.int8), struct((out,), jnp.float32)
    else:
        scales = (-(-out // 128), -(-inner // 128))
        args = struct((out, inner), jnp.float8_e4m3fn), struct(scales, jnp.float32)
    return args, qmm.jax.quantized_matmul


def step_bytes(generation: str, batch: int, formats: tuple[str, ...] = ("fp8",)) -> dict:
    """Compiled and bound bytes of one decode step's projections: "bf16" and each of
    ``formats`` ("fp8", "int8", "int4"), with "<fmt> bound" beside each."""
    device = tpu_device(generation)
    totals = {key: 0.0 for f in ("bf16", *formats) for key in (f, f"{f} bound")}
    for out, inner in PROJECTIONS.values():
        x = jax.ShapeDtypeStruct((batch, inner), jnp.bfloat16)
        w16 = jax.ShapeDtypeStruct((out, inner), jnp.bfloat16)
        io = 2 * batch * (inner + out)
        totals["bf16"] += LAYERS * compiled_bytes(lambda a, w: a @ w.T, (x, w16), device)
        totals["bf16 bound"] += LAYERS * (io + 2 * out * inner)
        for fmt in formats:
            (weight, scale), op = _quantized(fmt, out, inner)
            call = lambda a, w, s, op=op: op(a, w, s, implementation="pallas")
            totals[fmt] += LAYERS * compiled_bytes(call, (x, weight, scale), device)
            stored = weight.size * weight.dtype.itemsize + 4 * scale.size
            totals[f"{fmt} bound"] += LAYERS * (io + stored)
    return totals


FORMATS = ("fp8", "int8", "int4")


def main(generations: list[str]) -> None:
    header = "| gen | batch | bf16 MB | bf16 / bound |"
    for fmt in FORMATS:
        header += f" {fmt} MB | {fmt} / bound | {fmt} / bf16 |"
    print(header)
    print("|---" * (4 + 3 * len(FORMATS)) + "|")
    for generation in generations:
        for batch in BATCHES:
            with filtered_libtpu_stderr(), no_persistent_cache():
                t = step_bytes(generation, batch, FORMATS)
            row = f"| {generation} | {batch} | {t['bf16'] / 1e6:,.0f} | "
            row += f"{t['bf16'] / t['bf16 bound']:.3f} |"
            for fmt in FORMATS:
                row += f" {t[fmt] / 1e6:,.0f} | {t[fmt] / t[f'{fmt} bound']:.3f} | "
                row += f"{t[fmt] / t['bf16']:.3f} |"
            print(row, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["v5e", "v6e"])
