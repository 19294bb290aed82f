"""Temporary HBM of a training step's loss at LM-head sizes, from deviceless TPU compiles.

For each TPU generation, head (Llama-3-8B: V=128256, Qwen3-8B: V=151936; H=4096) and token count,
``jax.value_and_grad`` of the loss with respect to the hidden states and the head weight (bf16) is
compiled without a TPU and ``memory_analysis().temp_size_in_bytes`` is read for

* ``stock``: what Transformers computes: bf16 logits ``h @ W.T``, then ``log_softmax`` in f32
  and the labels' entries (``ForCausalLMLoss``), as XLA compiles it;
* ``kernel-hub``: the linear-cross-entropy kernel (Pallas, ``implementation="pallas"``), with
  Transformers' semantics (ignore_index, mean over counted tokens);
* ``tokamax``: Tokamax's ``linear_softmax_cross_entropy_loss`` (``mosaic_tpu``; no ignore_index,
  soft-capping, scaling or label smoothing), given the weight in its own [H, V] layout (a
  transpose of a [V, H] head would add two weight-sized copies).

When XLA refuses a program because its temporaries exceed the chip's HBM, the figure it
reports ("the total memory required for HLO temporaries (25.94G)") is recorded instead.

These are compiler figures for a deviceless topology (a model of the TPU, not a measurement on
one). Run from a checkout:

    PYTHONPATH=$PWD python benchmarks/linear_cross_entropy_memory.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys

HIDDEN = 4096
HEADS = {"llama3-8b": 128256, "qwen3-8b": 151936}
TOKENS = (8192, 32768)
GENERATIONS = ("v5e", "v6e")
MIB = 1024 * 1024
_TOO_BIG = re.compile(r"required for HLO temporaries \(([\d.]+)([MG])\)")


def _losses():
    import jax
    import jax.numpy as jnp

    from kernel_hub import get_kernel

    api = get_kernel("linear-cross-entropy").KERNEL.jax

    def stock(h, w, labels):
        logits = jnp.dot(h, w.T).astype(jnp.float32)
        log_probs = jax.nn.log_softmax(logits, axis=-1)
        counted = labels != -100
        picked = jnp.take_along_axis(log_probs, jnp.maximum(labels, 0)[:, None], axis=-1)[:, 0]
        return -jnp.sum(jnp.where(counted, picked, 0.0)) / jnp.sum(counted)

    def kernel_hub(h, w, labels):
        return api.linear_cross_entropy(h, w, labels, implementation="pallas")

    def tokamax(h, w_hv, labels):
        import tokamax as tx

        return tx.linear_softmax_cross_entropy_loss(
            h, labels, w_hv, reduction="mean", implementation="mosaic_tpu"
        )

    # name -> (loss, whether the weight is [H, V])
    return {"stock": (stock, False), "kernel-hub": (kernel_hub, False), "tokamax": (tokamax, True)}


def temp_bytes(fn, generation: str, tokens: int, vocab: int, hv: bool = False) -> int:
    """Temporary bytes of the compiled forward + backward (gradients of h and W); ``hv``: the
    weight is [H, V]."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from kernel_hub.bench.compile_check import no_persistent_cache
    from kernel_hub.topologies import filtered_libtpu_stderr, tpu_device

    device = tpu_device(generation)
    sharding = SingleDeviceSharding(device)
    args = (
        jax.ShapeDtypeStruct((tokens, HIDDEN), jnp.bfloat16, sharding=sharding),
        jax.ShapeDtypeStruct(
            (HIDDEN, vocab) if hv else (vocab, HIDDEN), jnp.bfloat16, sharding=sharding
        ),
        jax.ShapeDtypeStruct((tokens,), jnp.int32, sharding=sharding),
    )
    step = jax.value_and_grad(fn, argnums=(0, 1))
    with filtered_libtpu_stderr(), no_persistent_cache(), jax.default_device(device):
        compiled = jax.jit(step).trace(*args).lower().compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)


def _cell(figure: int | str) -> str:
    if isinstance(figure, int):
        return f"{figure / MIB:,.1f}"
    too_big = _TOO_BIG.search(figure)
    if too_big:
        value = float(too_big.group(1)) * (1024 if too_big.group(2) == "G" else 1)
        return f"{value:,.0f} (exceeds HBM, not compiled)"
    return "compile failed (see JSON)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--generations", nargs="+", default=list(GENERATIONS))
    parser.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    options = parser.parse_args(argv)
    sys.argv = sys.argv[:1]  # Tokamax parses absl flags from the command line on first use
    rows = []
    print("| TPU | head | tokens | stock XLA MiB | kernel-hub MiB | Tokamax MiB |")
    print("|---|---|---|---|---|---|")
    for generation in options.generations:
        for head, vocab in HEADS.items():
            for tokens in options.tokens:
                figures = {}
                for name, (fn, hv) in _losses().items():
                    try:
                        figures[name] = temp_bytes(fn, generation, tokens, vocab, hv)
                    except Exception as exc:  # a compile failure is a result
                        figures[name] = f"{type(exc).__name__}: {str(exc)[:300]}"
                rows.append(
                    {"generation": generation, "head": head, "vocab": vocab, "tokens": tokens}
                    | figures
                )
                cells = [_cell(figures[name]) for name in ("stock", "kernel-hub", "tokamax")]
                print(f"| {generation} | {head} | {tokens} | " + " | ".join(cells) + " |")
                sys.stdout.flush()
    if options.json:
        with open(options.json, "w") as f:
            json.dump({"hidden": HIDDEN, "dtype": "bfloat16", "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
