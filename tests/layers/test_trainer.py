"""transformers.Trainer with KernelizeCallback: bf16 mixed precision on f32 weights, gradient
checkpointing and torch_compile, against stock Trainer runs of the same model and data."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import (
    BertForMaskedLM,
    LlamaForCausalLM,
    Trainer,
    TrainingArguments,
)

from kernel_hub import Mode, get_kernel
from kernel_hub.errors import KernelHubError
from kernel_hub.layers.integrations.trainer import KernelizeCallback, training_mode
from kernel_hub.models.tiny import tiny_model

STEPS = 4
BF16_RTOL = 1e-2


def tiny_llama(**fields):
    return tiny_model(LlamaForCausalLM, **fields).train()


def tiny_bert(**fields):
    # No dropout: runs are compared step by step, and the kernel's dropout stream is not torch's.
    return tiny_model(
        BertForMaskedLM,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        **fields,
    ).train()


MODELS = {"llama": tiny_llama, "bert": tiny_bert}


def dataset(count: int, seq: int = 12):
    """Token rows with a padded tail on every other row (the attention mask matters)."""
    generator = torch.Generator().manual_seed(0)
    rows = []
    for i, ids in enumerate(torch.randint(1, 128, (count, seq), generator=generator)):
        mask = torch.ones(seq, dtype=torch.long)
        if i % 2:
            mask[-3:] = 0
        labels = torch.where(mask.bool(), ids, -100)
        rows.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return rows


def train(model, tmp_path, *, kernelized: bool, **options):
    """Losses of each step, the final eval loss, the callback (or None) and the trained model."""
    args = TrainingArguments(
        output_dir=str(tmp_path),
        bf16=True,
        use_cpu=True,
        max_steps=STEPS,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        logging_steps=1,
        learning_rate=1e-3,
        seed=0,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        **options,
    )
    callback = KernelizeCallback() if kernelized else None
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=dataset(16),
        eval_dataset=dataset(8),
        callbacks=[callback] if callback else None,
    )
    trainer.train()
    eval_loss = trainer.evaluate()["eval_loss"]
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return losses, eval_loss, callback, trainer.model


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts calls of the attention, norm and rotary kernels' torch ops made by the swaps."""
    calls: dict[str, int] = {}

    def count(module, name, key):
        op = getattr(module, name)

        def counted(*args, **kwargs):
            calls[key] = calls.get(key, 0) + 1
            return op(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)

    integrations = get_kernel("attention").KERNEL.integration("transformers")
    count(integrations, "attention_with_lse", "attention")
    count(integrations, "dot_product_attention", "attention")
    count(integrations, "attention_with_dense_mask", "attention")
    count(get_kernel("layernorm").layers, "layer_norm_any", "layernorm")
    count(get_kernel("rmsnorm").layers, "rms_norm", "rmsnorm")
    count(get_kernel("rotary").KERNEL.integration("transformers"), "rotary_embedding", "rotary")
    return calls


OPTIONS = {
    "plain": {},
    "gradient-checkpointing": {"gradient_checkpointing": True},
    "torch-compile": {"torch_compile": True, "torch_compile_backend": "aot_eager"},
}
NORM = {"llama": "rmsnorm", "bert": "layernorm"}
MODEL_FIELDS = {"torch-compile": {"num_hidden_layers": 1}}
"""torch.compile traces every layer: one shows the compiled swaps with less to trace and compile."""
STOCK_RUNS: dict[tuple[str, int], tuple[list[float], float]] = {}


def stock_run(name: str, options: str, base, tmp_path) -> tuple[list[float], float]:
    """Losses and eval loss of the stock Trainer run that the kernelized run with ``options`` is
    compared with: the plain run of the same model, made once per model and size. Gradient
    checkpointing recomputes the same forward and aot_eager runs the same ops, so neither
    changes what stock computes (a stock compiled run would only retrace it); the kernelized
    runs take every option, which is what is tested."""
    key = (name, base.config.num_hidden_layers)
    if key not in STOCK_RUNS:
        losses, eval_loss, _, _ = train(copy.deepcopy(base), tmp_path, kernelized=False)
        STOCK_RUNS[key] = (losses, eval_loss)
    return STOCK_RUNS[key]


@pytest.mark.parametrize(
    "options",
    [
        "plain",
        "gradient-checkpointing",
        pytest.param("torch-compile", marks=pytest.mark.slow),
    ],
)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_bf16_trainer_run_matches_stock(name, options, tmp_path, kernel_calls):
    base = MODELS[name](**MODEL_FIELDS.get(options, {}))
    assert all(p.dtype == torch.float32 for p in base.parameters())
    stock_losses, stock_eval = stock_run(name, options, base, tmp_path)
    assert not kernel_calls
    losses, eval_loss, callback, model = train(
        copy.deepcopy(base), tmp_path, kernelized=True, **OPTIONS[options]
    )

    report = callback.report
    assert report.mode == training_mode_label(options), report
    swapped = [e for e in report.entries if e.swapped_to]
    # a causal LM's loss too (linear-cross-entropy: the logits are skipped in training) and its
    # rotary_pos_emb slot (the rotary kernel)
    causal = {"causal LM loss", "rotary"} if name == "llama" else set()
    assert {e.kind for e in swapped} == {"layer", "attention"} | causal, report
    # continuous batching (serving) is left alone in training mode by design
    left_alone = [e for e in report.entries if not e.swapped_to]
    assert all(e.kind == "continuous batching" for e in left_alone), report
    assert kernel_calls.get("attention", 0) > 0 and kernel_calls.get(NORM[name], 0) > 0
    assert (kernel_calls.get("rotary", 0) > 0) == (name == "llama")

    assert len(losses) == len(stock_losses) == STEPS
    torch.testing.assert_close(losses, stock_losses, rtol=BF16_RTOL, atol=0)
    torch.testing.assert_close(eval_loss, stock_eval, rtol=BF16_RTOL, atol=0)
    # The swaps survived train() and evaluate() (their train/eval mode switches).
    for entry in swapped:
        if entry.kind == "layer":
            assert "forward" in model.get_submodule(entry.module).__dict__, entry.module
    assert model.config._attn_implementation.startswith("kernel_hub"), report


def training_mode_label(options: str) -> str:
    return "training+torch_compile" if options == "torch-compile" else "training"


def test_mode_follows_the_training_arguments(tmp_path):
    plain = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    compiled = TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to=[], torch_compile_backend="aot_eager"
    )
    assert training_mode(plain) == Mode.TRAINING
    assert training_mode(compiled) == Mode.TRAINING | Mode.TORCH_COMPILE


def test_refuses_a_model_using_hugging_face_kernels(tmp_path):
    model = tiny_llama()
    model._use_kernels = True  # what use_kernels=True leaves (the setter needs kernels>=0.18.2)
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    with pytest.raises(KernelHubError, match="use_kernels=True"):
        Trainer(model=model, args=args, callbacks=[KernelizeCallback()])
