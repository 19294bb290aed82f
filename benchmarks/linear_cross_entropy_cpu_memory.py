"""Peak host memory of one training step of a small wide-vocabulary causal LM, stock vs kernelized.

A 2-layer Llama (hidden 256, vocabulary 128k) takes one forward + backward on a batch of 4,096
tokens with labels, f32, on the CPU: once stock (the ``[4096, 128k]`` logits, their f32 copy and
log-softmax and the gradients of each), once after ``kernelize`` (the linear-cross-entropy loss
swap; the loss runs through the kernel's JAX implementation, the logits never exist). Each
variant runs in its own process; a sampler thread reads the process RSS every millisecond during
the measured step (the second one: the first compiles), and the peak above the RSS at the step's
start is reported.

    PYTHONPATH=$PWD JAX_PLATFORMS=cpu python benchmarks/linear_cross_entropy_cpu_memory.py
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time

MIB = 1024 * 1024
TOKENS, SEQUENCE = 4096, 1024


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _step_peak(step) -> int:
    """Peak RSS above the starting RSS while ``step()`` runs, in bytes."""
    start = _rss()
    peak = start
    done = threading.Event()

    def sample():
        nonlocal peak
        while not done.is_set():
            peak = max(peak, _rss())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        step()
    finally:
        done.set()
        sampler.join()
    return max(peak, _rss()) - start


def run_variant(kernelized: bool) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128256,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(config).train()
    swaps = {}
    if kernelized:
        from kernel_hub import kernel_mapping
        from kernel_hub.layers.kernelize import kernelize

        # the loss swap only: other kernels' swaps would change what is measured
        others = {op: "off" for op in ("rmsnorm", "attention", "ragged-attention", "gated-mlp")}
        with kernel_mapping(others):
            swaps = kernelize(model, device="cpu").counts()
    ids = torch.randint(0, config.vocab_size, (TOKENS // SEQUENCE, SEQUENCE))
    losses = []

    def step():
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())

    step()  # compiles (JAX) and allocates the gradients once
    peak = _step_peak(step)
    return {"kernelized": kernelized, "swaps": swaps, "peak_bytes": peak, "loss": losses[-1]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", choices=("stock", "kernelized"))
    parser.add_argument("--json", help="write the figures here")
    options = parser.parse_args(argv)
    if options.variant:
        print(json.dumps(run_variant(options.variant == "kernelized")))
        return 0
    rows = []
    for variant in ("stock", "kernelized"):
        out = subprocess.run(
            [sys.executable, __file__, "--variant", variant],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        rows.append({"variant": variant} | json.loads(out.strip().splitlines()[-1]))
    print("| variant | peak RSS above step start (MiB) | loss |")
    print("|---|---|---|")
    for row in rows:
        print(f"| {row['variant']} | {row['peak_bytes'] / MIB:,.0f} | {row['loss']:.6f} |")
    if options.json:
        with open(options.json, "w") as f:
            json.dump({"tokens": TOKENS, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
