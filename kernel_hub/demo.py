"""``kernel-hub demo``: tiny Transformers models, stock vs kernelized with every registry kernel.

Models are built from small configs with random weights (no downloads). For each: logits,
greedy generation and forward time of the stock model, then the same after ``kernelize``, then
``unkernelize`` must give back the stock logits bit for bit. The batch has a left-padded row, so
kernels that drop the attention mask show up as a logit difference.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .errors import UnknownNameError
from .layer_report import KernelizeReport
from .layers import kernelize, unkernelize

LOGIT_TOLERANCE = 1e-4
"""Largest |logit difference| (f32) the demo calls a match."""
_VOCAB = 128
_SHARED = dict(
    vocab_size=_VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, bos_token_id=1,
    eos_token_id=None,
)


def _llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(intermediate_size=128, **_SHARED))


def _mixtral() -> torch.nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        intermediate_size=96, num_local_experts=4, num_experts_per_tok=2, **_SHARED
    )
    return MixtralForCausalLM(config)


def _qwen3_moe() -> torch.nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        intermediate_size=96, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
        head_dim=16, **_SHARED,
    )
    return Qwen3MoeForCausalLM(config)


TINY_MODELS: dict[str, Callable[[], torch.nn.Module]] = {
    "llama": _llama,
    "mixtral": _mixtral,
    "qwen3_moe": _qwen3_moe,
}
DEFAULT_MODELS = ("llama", "mixtral")


def build_tiny_model(name: str, seed: int = 0) -> torch.nn.Module:
    """A tiny model with seeded random weights, in eval mode, f32.

    1-D parameters (norm weights, initialised to ones) are drawn around 1, so a kernel that
    ignores or misapplies the weight changes the logits.
    """
    if name not in TINY_MODELS:
        raise UnknownNameError("demo model", name, TINY_MODELS)
    torch.manual_seed(seed)
    model = TINY_MODELS[name]().eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.normal_(1.0, 0.2)
    return model


def demo_batch(batch: int = 2, length: int = 12, padding: int = 3) -> dict[str, torch.Tensor]:
    """Token ids and attention mask; the last row is left-padded by ``padding`` tokens."""
    generator = torch.Generator().manual_seed(1234)
    input_ids = torch.randint(3, _VOCAB, (batch, length), generator=generator)
    attention_mask = torch.ones(batch, length, dtype=torch.long)
    input_ids[-1, :padding] = _SHARED["pad_token_id"]
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
        **batch, max_new_tokens=new_tokens, do_sample=False, pad_token_id=_SHARED["pad_token_id"]
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
        "ok": max_diff <= LOGIT_TOLERANCE and greedy_identical and restored,
        "report": report.to_dict(),
    }


def run_demo(
    models: Sequence[str] = DEFAULT_MODELS,
    *,
    registry: str | Path | None = None,
    threads: int | None = None,
) -> list[dict[str, Any]]:
    """One row per model; a model whose kernelized run raises gets a row with ``error``.

    ``threads`` sets torch's intra-op threads for the run (restored after): on small CPUs
    torch's and XLA's thread pools contend and make timings meaningless.
    """
    for name in models:
        if name not in TINY_MODELS:
            raise UnknownNameError("demo model", name, TINY_MODELS)
    previous_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    rows = []
    try:
        for name in models:
            try:
                row = compare_model(name, registry=registry)
            except Exception as exc:  # a broken kernel must not hide the other models' results
                row = {"model": name, "ok": False, "error": f"{type(exc).__name__}: {exc}"}
            rows.append({**row, "torch_threads": torch.get_num_threads()})
    finally:
        torch.set_num_threads(previous_threads)
    return rows
