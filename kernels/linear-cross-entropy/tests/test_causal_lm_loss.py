"""The causal-LM loss swap: tiny Transformers models in training with labels and a padded batch
give the stock loss and gradients without logits; near misses are refused with the reason."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from transformers.loss.loss_utils import ForCausalLMLoss

from kernel_hub.layers.integrations.causal_lm_loss import CausalLMLossInterface
from kernel_hub.layers.kernelize import kernelize, unkernelize
from kernel_hub.models.tiny import tiny_config

SIZES = {"vocab_size": 512, "intermediate_size": 96}
"""Overrides of ``kernel_hub.models.tiny.TINY_SIZES``."""
MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {"head_dim": 16, "final_logit_softcapping": 3.0},
    ),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0}),
    "cohere": ("CohereConfig", "CohereForCausalLM", {"logit_scale": 0.25}),
}
FORMS = {"gemma2": "softcap=3", "cohere": "logit_scale=0.25"}


def tiny(name: str, dtype=torch.float32) -> torch.nn.Module:
    config_name, model_name, extra = MODELS[name]
    config = tiny_config(getattr(transformers, config_name), **SIZES, **extra)
    torch.manual_seed(0)
    return getattr(transformers, model_name)(config).to(dtype).train()


def batch(vocab: int = 512):
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (2, 24), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0  # left padding
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def loss_only_reference(model: torch.nn.Module) -> torch.nn.Module:
    """The kernelized model with only the loss switch undone: every other kernel-hub swap in
    place, so the comparison isolates the loss."""
    reference = copy.deepcopy(model)
    CausalLMLossInterface().restore(reference, {})
    assert "forward" not in reference.__dict__
    return reference


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_close_grads(got: dict, want: dict, rtol: float) -> None:
    assert got.keys() == want.keys()
    for name in want:
        scale = want[name].abs().max().clamp_min(1e-12)
        err = float((got[name] - want[name]).abs().max() / scale)
        assert err <= rtol, f"{name}: relative max error {err:.3g}"


@pytest.mark.parametrize("name", list(MODELS))
def test_training_loss_and_every_gradient_match_stock(name):
    model = tiny(name)
    report = kernelize(model, device="cpu")
    entry = next(e for e in report.entries if e.target == "ForCausalLMLoss")
    assert entry.swapped, entry.reason
    assert FORMS.get(name, "plain logits") in entry.swapped_to
    reference = loss_only_reference(model)

    out = model(**batch())
    assert out.logits is None
    out.loss.backward()
    want = reference(**batch())
    want.loss.backward()
    torch.testing.assert_close(out.loss, want.loss, rtol=1e-5, atol=0)
    assert_close_grads(grads(model), grads(reference), 1e-5)


def test_llama_matches_the_stock_model_and_num_items_in_batch():
    model = tiny("llama")
    stock = copy.deepcopy(model)
    kernelize(model, device="cpu")
    items = torch.tensor(33)
    out = model(**batch(), num_items_in_batch=items)
    out.loss.backward()
    want = stock(**batch(), num_items_in_batch=items)
    want.loss.backward()
    torch.testing.assert_close(out.loss, want.loss, rtol=1e-5, atol=0)
    assert_close_grads(grads(model), grads(stock), 1e-5)


def test_kernel_op_runs_and_eval_keeps_logits(monkeypatch):
    from kernel_hub import get_kernel

    adapter = get_kernel("linear-cross-entropy").KERNEL.integration("transformers")
    calls = []
    original = adapter.linear_cross_entropy
    monkeypatch.setattr(adapter, "linear_cross_entropy", lambda *a: calls.append(a) or original(*a))
    model = tiny("llama")
    kernelize(model, device="cpu")
    model(**batch())
    assert len(calls) == 1 and calls[0][0].shape == (48, 64)
    model.eval()
    out = model(**batch())
    assert len(calls) == 1 and out.logits.shape == (2, 24, 512)
    assert unkernelize(model) and "forward" not in model.__dict__


def test_tuple_output_and_positional_labels():
    model = tiny("llama")
    stock = copy.deepcopy(model)
    kernelize(model, device="cpu")
    b = batch()
    got = model(
        b["input_ids"], b["attention_mask"], None, None, None, b["labels"], return_dict=False
    )
    want = stock(**b)
    torch.testing.assert_close(got[0], want.loss, rtol=1e-5, atol=0)


def test_bf16_autocast_within_stated_tolerance():
    """bf16 autocast: the stock path rounds the logits to bf16 before its f32 loss, the kernel
    keeps them in f32; the loss agrees within 1e-2 relative, gradients within 5e-2."""
    model = tiny("qwen3")
    kernelize(model, device="cpu")
    reference = loss_only_reference(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(**batch())
        want = reference(**batch())
    out.loss.backward()
    want.loss.backward()
    torch.testing.assert_close(out.loss, want.loss, rtol=1e-2, atol=0)
    assert_close_grads(grads(model), grads(reference), 5e-2)


@pytest.mark.slow
def test_fullgraph_compile_with_ignore_index_matches_stock():
    model = tiny("gemma2")
    kernelize(model, device="cpu", mode="training+torch_compile")
    reference = loss_only_reference(model)
    step = torch.compile(lambda **kw: model(**kw).loss, backend="aot_eager", fullgraph=True)
    loss = step(**batch())
    loss.backward()
    want = reference(**batch()).loss
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=0)
    assert_close_grads(grads(model), grads(reference), 1e-5)


def _loss_entry(model):
    return next(e for e in kernelize(model, device="cpu").entries if e.target == "ForCausalLMLoss")


def test_custom_loss_function_is_refused():
    model = tiny("llama")
    weights = torch.ones(512)
    model.loss_function = lambda logits, labels, vocab_size, **kw: (
        torch.nn.functional.cross_entropy(
            logits.flatten(0, 1)[:-1], labels.flatten()[1:], weight=weights
        )
    )
    entry = _loss_entry(model)
    assert not entry.swapped and "not Transformers' ForCausalLMLoss" in entry.reason


def test_logit_post_processing_the_kernel_lacks_is_refused():
    class OffsetForCausalLM(transformers.LlamaForCausalLM):
        def forward(self, input_ids=None, labels=None, logits_to_keep=0, **kwargs):
            hidden = self.model(input_ids=input_ids, **kwargs).last_hidden_state
            hidden = transformers.modeling_utils.slice_logits_to_keep(hidden, logits_to_keep)
            logits = self.lm_head(hidden) + 1.0  # a bias after the head
            loss = None
            if labels is not None:
                loss = self.loss_function(logits, labels, self.config.vocab_size, **kwargs)
            return transformers.modeling_outputs.CausalLMOutputWithPast(loss=loss, logits=logits)

    config = tiny_config(transformers.LlamaConfig, **SIZES)
    entry = _loss_entry(OffsetForCausalLM(config).train())
    assert not entry.swapped and "post-processed in a way the kernel does not implement" in (
        entry.reason
    )


def test_head_that_is_not_a_linear_is_refused():
    model = tiny("llama")
    model.lm_head = torch.nn.Sequential(torch.nn.Linear(64, 512, bias=False))
    entry = _loss_entry(model)
    assert not entry.swapped and "not a plain torch.nn.Linear" in entry.reason


def test_stock_loss_is_transformers_for_causal_lm_loss():
    """The probe's premise: the models above use ForCausalLMLoss (else they would be refused)."""
    assert tiny("llama").loss_function is ForCausalLMLoss
