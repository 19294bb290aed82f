"""``kernel-hub demo``: tiny Transformers models, stock vs kernelized with every registry kernel.

Models are built from small configs with random weights (no downloads). For each: logits,
greedy generation and forward time of the stock model, then the same after ``kernelize``, then
``unkernelize`` must give back the stock logits bit for bit. The batch has a left-padded row, so
kernels that drop the attention mask show up as a logit difference.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kernel_hub.errors import UnknownNameError
from kernel_hub.layers.kernelize import kernelize, unkernelize
from kernel_hub.layers.report import KernelizeReport

from .tiny import (
    CAUSAL_LM_MODELS,
    DEFAULT_MODELS,
    PAD_TOKEN_ID,
    VOCAB_SIZE,
    build_tiny_model,
)

LOGIT_TOLERANCE = 1e-4
"""Largest |logit difference| (f32) the demo calls a match."""


def demo_batch(batch: int = 2, length: int = 12, padding: int = 3) -> dict[str, torch.Tensor]:
    """Token ids and attention mask; the last row is left-padded by ``padding`` tokens."""
    generator = torch.Generator().manual_seed(1234)
    input_ids = torch.randint(3, VOCAB_SIZE, (batch, length), generator=generator)
    attention_mask = torch.ones(batch, length, dtype=torch.long)
    input_ids[-1, :padding] = PAD_TOKEN_ID
    attention_mask[-1, :padding] = 0
    return {"input_ids": input_ids, "attention_mask": attention_mask}


@dataclass(frozen=True)
class _Run:
    logits: torch.Tensor
    tokens: torch.Tensor
    forward_ms: float


def greedy(model: torch.nn.Module, batch: dict[str, torch.Tensor], new_tokens: int) -> torch.Tensor:
    """Greedy generation of ``new_tokens`` tokens (no early stop: the tiny configs have no EOS)."""
    return model.generate(
        **batch, max_new_tokens=new_tokens, do_sample=False, pad_token_id=PAD_TOKEN_ID
    )


def _run(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], new_tokens: int, repeats: int
) -> _Run:
    with torch.inference_mode():
        logits = model(**batch).logits
        tokens = greedy(model, batch, new_tokens)
        model(**batch)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            model(**batch)
            times.append(time.perf_counter() - start)
    return _Run(logits, tokens, 1e3 * statistics.median(times))


def compare_model(
    name: str, *, registry: str | Path | None = None, new_tokens: int = 6, repeats: int = 5
) -> dict[str, Any]:
    """Stock vs kernelized vs unkernelized for one tiny model; a JSON-ready row."""
    model = build_tiny_model(name)
    batch = demo_batch()
    stock = _run(model, batch, new_tokens, repeats)
    report: KernelizeReport = kernelize(model, mode="inference", registry=registry)
    kernelized = _run(model, batch, new_tokens, repeats)
    unkernelize(model)
    with torch.inference_mode():
        restored = torch.equal(model(**batch).logits, stock.logits)
    real = batch["attention_mask"].bool()
    max_diff = (kernelized.logits - stock.logits)[real].abs().max().item()
    greedy_identical = torch.equal(kernelized.tokens, stock.tokens)
    return {
        "model": type(model).__name__,
        "swapped": report.counts(),
        "left_alone": len(report.left_alone),
        "max_logit_diff": max_diff,
        "greedy_identical": greedy_identical,
        "stock_ms": stock.forward_ms,
        "kernelized_ms": kernelized.forward_ms,
        "unkernelize_restores": restored,
        "builds": builds_label(report.origins),
        "ok": max_diff <= LOGIT_TOLERANCE and greedy_identical and restored,
        "report": report.to_dict(),
    }


def builds_label(origins: Mapping[str, str]) -> str:
    """Where the swapped ops' kernels came from: ``in-tree`` when every one is, else each source
    with its ops (``hub: attention, rmsnorm; in-tree: rotary``); ``none`` when nothing swapped."""
    by_source: dict[str, list[str]] = {}
    for op, source in sorted(origins.items()):
        by_source.setdefault(source, []).append(op)
    if set(by_source) == {"in-tree"}:
        return "in-tree"
    order = ("hub", "local", "in-tree")
    labels = [f"{s}: {', '.join(by_source[s])}" for s in sorted(by_source, key=order.index)]
    return "; ".join(labels) or "none"


def run_demo(
    models: Sequence[str] = DEFAULT_MODELS,
    *,
    registry: str | Path | None = None,
    threads: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """One row per model; a model whose kernelized run raises gets a row with ``error``.

    ``threads`` sets torch's intra-op threads for the run (restored after): on small CPUs
    torch's and XLA's thread pools contend and make timings meaningless. ``progress`` gets a
    line as each model starts (the first kernel calls compile, which takes seconds).
    """
    for name in models:
        if name not in CAUSAL_LM_MODELS:
            raise UnknownNameError("demo model", name, CAUSAL_LM_MODELS)
    previous_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    rows = []
    try:
        for index, name in enumerate(models, 1):
            if progress is not None:
                progress(
                    f"[{index}/{len(models)}] {name}: stock, then kernelized (first calls compile)"
                )
            try:
                row = compare_model(name, registry=registry)
            except Exception as exc:  # a broken kernel must not hide the other models' results
                row = {"model": name, "ok": False, "error": f"{type(exc).__name__}: {exc}"}
            rows.append({**row, "torch_threads": torch.get_num_threads()})
    finally:
        torch.set_num_threads(previous_threads)
    return rows
