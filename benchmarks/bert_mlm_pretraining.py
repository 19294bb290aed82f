"""Masked-LM pretraining of a BERT with transformers.Trainer: fp32 vs bf16, stock vs kernel-hub.

The seed benchmark of Hugging Face's TPU story (BERT-large pretraining in bf16 vs fp32), scaled to
a small BERT for a CPU. Four runs from the same initial weights and batches, in one process:
{fp32, bf16 mixed precision (f32 master weights)} x {stock, kernelized with KernelizeCallback}.
It prints the loss of every step side by side, steps/s per run (median over the steps after
``--warmup``, so compilation is left out), and writes a JSON record and a plot.

    python benchmarks/bert_mlm_pretraining.py --cpu --json benchmarks/bert_mlm_pretraining.json \
        --plot benchmarks/results/bert-mlm-cpu-2026-12-01.png

The recorded run is benchmarks/bert_mlm_pretraining.json with its plot in benchmarks/results/
(whose JSON files are only ``kernel-hub bench`` / ``compile-check`` records).

BERT-large on a TPU VM (TorchTPU or torch_xla installed; Trainer picks the TPU device itself):

    python benchmarks/bert_mlm_pretraining.py --layers 24 --hidden 1024 --heads 16 \
        --intermediate 4096 --seq 512 --batch 8 --vocab 30522 --steps 1000 --warmup 20

Data is synthetic (Zipf-distributed token ids, 15% masked as BERT does: 80% [MASK], 10% random,
10% kept), so nothing is downloaded; the loss falls from ln(vocab) toward the unigram entropy.
Attention dropout defaults to 0: with dropout kernel-hub's attention hands the call to torch's
SDPA (the kernel has none), which would time SDPA, not the kernel. What a CPU run says: whether
the kernelized runs track the stock loss curves in each precision, and the per-step overhead of
the bridge on a CPU; it says nothing about TPU speed (the Pallas kernels run in XLA form on CPU).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts its OpenMP pool

import argparse
import copy
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import (
    BertConfig,
    BertForMaskedLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from kernel_hub.layers.integrations.trainer import KernelizeCallback
from kernel_hub.platform import describe_host

MASK_ID, FIRST_TOKEN = 1, 2  # 0 is padding


def mlm_dataset(count: int, seq: int, vocab: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """Zipf-distributed token rows with BERT's masking; labels -100 where nothing is predicted."""
    generator = torch.Generator().manual_seed(seed)
    ranks = torch.arange(1, vocab - FIRST_TOKEN + 1, dtype=torch.float64)
    weights = 1.0 / ranks
    ids = FIRST_TOKEN + torch.multinomial(weights, count * seq, True, generator=generator)
    ids = ids.view(count, seq)
    chosen = torch.rand(count, seq, generator=generator) < 0.15
    labels = torch.where(chosen, ids, -100)
    roll = torch.rand(count, seq, generator=generator)
    random_ids = torch.randint(FIRST_TOKEN, vocab, (count, seq), generator=generator)
    inputs = torch.where(chosen & (roll < 0.8), MASK_ID, ids)
    inputs = torch.where(chosen & (roll >= 0.8) & (roll < 0.9), random_ids, inputs)
    mask = torch.ones(count, seq, dtype=torch.long)
    return [
        {"input_ids": i, "attention_mask": m, "labels": lab}
        for i, m, lab in zip(inputs, mask, labels, strict=True)
    ]


class StepTimes(TrainerCallback):
    """Wall-clock time of each optimizer step."""

    def __init__(self):
        self.times: list[float] = []
        self._start = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self._start)


def run(base: BertForMaskedLM, data, args: argparse.Namespace, *, bf16: bool, kernelized: bool):
    """One Trainer run from a copy of ``base``: losses per step, step times, kernelize summary."""
    model = copy.deepcopy(base)
    timer = StepTimes()
    callbacks = [timer]
    if kernelized:
        kernelize = KernelizeCallback()
        callbacks.append(kernelize)
    with tempfile.TemporaryDirectory() as output_dir:
        training = TrainingArguments(
            output_dir=output_dir,
            bf16=bf16,
            use_cpu=args.cpu,
            max_steps=args.steps,
            per_device_train_batch_size=args.batch,
            learning_rate=args.lr,
            warmup_steps=max(1, args.steps // 10),
            weight_decay=0.01,
            logging_steps=1,
            seed=args.seed,
            data_seed=args.seed,
            report_to=[],
            save_strategy="no",
            disable_tqdm=True,
            dataloader_num_workers=0,
        )
        trainer = Trainer(model=model, args=training, train_dataset=data, callbacks=callbacks)
        trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    timed = timer.times[args.warmup :] or timer.times
    summary = str(kernelize.report).splitlines()[0] if kernelized else "stock"
    return {
        "losses": [float(loss) for loss in losses],
        "step_seconds": timer.times,
        "steps_per_second": 1.0 / statistics.median(timed),
        "kernelize": summary,
    }


def print_table(results: dict[str, dict]) -> None:
    names = list(results)
    print("step " + " ".join(f"{name:>16}" for name in names))
    for step in range(len(results[names[0]]["losses"])):
        print(f"{step + 1:>4} " + " ".join(f"{results[n]['losses'][step]:>16.4f}" for n in names))
    print("steps/s " + " ".join(f"{results[n]['steps_per_second']:>13.3f}" for n in names))
    for precision in ("fp32", "bf16"):
        stock, kernel = results[f"{precision} stock"], results[f"{precision} kernel-hub"]
        diff = max(abs(a - b) for a, b in zip(stock["losses"], kernel["losses"], strict=True))
        ratio = kernel["steps_per_second"] / stock["steps_per_second"]
        print(
            f"{precision}: max |loss kernel-hub - stock| {diff:.3g}; kernel-hub/stock steps/s "
            f"{ratio:.2f}"
        )
    for name in names:
        print(f"{name}: {results[name]['kernelize']}")


def plot(results: dict[str, dict], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (curves, speed) = plt.subplots(1, 2, figsize=(11, 4), width_ratios=(2, 1))
    styles = {"stock": "-", "kernel-hub": "--"}
    for name, result in results.items():
        steps = range(1, len(result["losses"]) + 1)
        curves.plot(steps, result["losses"], styles[name.split(" ", 1)[1]], label=name)
    curves.set(xlabel="step", ylabel="MLM loss", title="loss per step")
    curves.legend()
    speed.bar(
        list(results),
        [r["steps_per_second"] for r in results.values()],
        color=["C0", "C1", "C2", "C3"],
    )
    speed.set(ylabel="steps/s (median after warmup)", title="throughput")
    speed.tick_params(axis="x", rotation=30)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of steps/s")
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--attention-dropout", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cpu", action="store_true", help="train on the CPU (use_cpu=True)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()

    config = BertConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        intermediate_size=args.intermediate,
        max_position_embeddings=max(512, args.seq),
        attention_probs_dropout_prob=args.attention_dropout,
    )
    torch.manual_seed(args.seed)
    base = BertForMaskedLM(config)
    data = mlm_dataset(args.steps * args.batch, args.seq, args.vocab, args.seed)
    results = {}
    for precision in ("fp32", "bf16"):
        for kernelized in (False, True):
            name = f"{precision} {'kernel-hub' if kernelized else 'stock'}"
            results[name] = run(base, data, args, bf16=precision == "bf16", kernelized=kernelized)
            print(f"{name}: done, {results[name]['steps_per_second']:.3f} steps/s", flush=True)
    shape = (
        f"BERT {args.layers}L h{args.hidden} {args.heads} heads, seq {args.seq}, batch "
        f"{args.batch}, {args.steps} steps"
    )
    print(shape)
    print_table(results)
    record = {
        "config": vars(args) | {"json": None, "plot": None},
        "host": describe_host(),
        "shape": shape,
        "runs": results,
    }
    if args.json:
        args.json.write_text(json.dumps(record, indent=1, default=str) + "\n")
    if args.plot:
        host = ", ".join(f"{k} {v}" for k, v in record["host"].items())
        plot(results, f"{shape}; {host}", args.plot)


if __name__ == "__main__":
    main()
