"""Deviceless decode-step bytes of Llama-3-8B's linear layers: bf16 weights (XLA's dot) against
fp8 weights (the quantized-matmul Pallas kernel), per TPU generation and batch, beside the
hand-count bound (activations, weights with their scales and outputs, each read or written once).

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


def step_bytes(generation: str, batch: int) -> dict[str, float]:
    qmm = get_kernel("quantized-matmul")
    device = tpu_device(generation)
    totals = {"bf16": 0.0, "bf16 bound": 0.0, "fp8": 0.0, "fp8 bound": 0.0}
    for out, inner in PROJECTIONS.values():
        x = jax.ShapeDtypeStruct((batch, inner), jnp.bfloat16)
        w16 = jax.ShapeDtypeStruct((out, inner), jnp.bfloat16)
        w8 = jax.ShapeDtypeStruct((out, inner), jnp.float8_e4m3fn)
        scale = jax.ShapeDtypeStruct((-(-out // 128), -(-inner // 128)), jnp.float32)
        io = 2 * batch * (inner + out)
        totals["bf16"] += LAYERS * compiled_bytes(lambda a, w: a @ w.T, (x, w16), device)
        totals["bf16 bound"] += LAYERS * (io + 2 * out * inner)
        fp8 = lambda a, w, s: qmm.jax.quantized_matmul(a, w, s, implementation="pallas")
        totals["fp8"] += LAYERS * compiled_bytes(fp8, (x, w8, scale), device)
        totals["fp8 bound"] += LAYERS * (io + out * inner + 4 * scale.shape[0] * scale.shape[1])
    return totals


def main(generations: list[str]) -> None:
    print("| gen | batch | bf16 MB | bf16 / bound | fp8 MB | fp8 / bound | fp8 / bf16 |")
    print("|---|---|---|---|---|---|---|")
    for generation in generations:
        for batch in BATCHES:
            with filtered_libtpu_stderr(), no_persistent_cache():
                t = step_bytes(generation, batch)
            print(
                f"| {generation} | {batch} | {t['bf16'] / 1e6:,.0f} | "
                f"{t['bf16'] / t['bf16 bound']:.3f} | {t['fp8'] / 1e6:,.0f} | "
                f"{t['fp8'] / t['fp8 bound']:.3f} | {t['fp8'] / t['bf16']:.3f} |",
                flush=True,
            )


if __name__ == "__main__":
    main(sys.argv[1:] or ["v5e", "v6e"])
