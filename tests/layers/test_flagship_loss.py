"""The causal-LM loss of the newest flagships (Gemma 4, Llama 4, GPT-OSS, Falcon-H1, Granite 4
hybrid) on the fused linear-cross-entropy path: each probe finds the model's logit form (Gemma 4's
soft-cap, Falcon-H1's head multiplier, Granite's logits scaling) and whether the router's
auxiliary loss is added; the loss and every gradient of a GPT-OSS step with that auxiliary loss
match stock; near misses (another coefficient, an auxiliary loss only with labels, a multiplier
that differs from its config) are refused.
"""

from __future__ import annotations

import copy

import pytest
import torch

from kernel_hub import kernelize, unkernelize
from kernel_hub.layers.integrations import causal_lm_loss
from kernel_hub.layers.integrations.causal_lm_loss import LogitForm, Refused, probe
from kernel_hub.models import architectures as archs
from kernel_hub.testing import registry_with_ops

ONE_LAYER = {"num_hidden_layers": 1}
MOE = {"output_router_logits": True, "router_aux_loss_coef": 0.3}
FLAGSHIPS = {
    # model type: (config overrides at the real models' kind of values, form, aux policy)
    "gemma4_text": ({"final_logit_softcapping": 30.0}, LogitForm(softcap=30.0), None),
    "llama4": ({}, LogitForm(), None),
    "gpt_oss": (MOE, LogitForm(), True),
    "falcon_h1": ({"lm_head_multiplier": 0.0390625}, LogitForm(scale=0.0390625), None),
    "granitemoehybrid": ({**MOE, "logits_scaling": 8.0}, LogitForm(scale=0.125), True),
}


def _build(model_type: str, **overrides) -> torch.nn.Module:
    (arch,) = [a for a in archs.architectures(("decoder",)) if a.model_type == model_type]
    return archs.build(arch, {**ONE_LAYER, **overrides}).train()


@pytest.mark.parametrize("model_type", list(FLAGSHIPS))
def test_flagship_causal_lms_are_probed_with_their_logit_form(model_type: str) -> None:
    overrides, form, aux = FLAGSHIPS[model_type]
    assert probe(_build(model_type, **overrides)) == ("model", form, aux)


@pytest.fixture(scope="module")
def gpt_oss() -> torch.nn.Module:
    return _build("gpt_oss", **MOE)


def _labels(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    return inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def test_router_aux_loss_is_added_as_stock_and_every_gradient_matches(tmp_path, gpt_oss) -> None:
    """f64 weights (the experts' eager loop: grouped_mm takes no f64); stock's loss itself is f32
    (``ForCausalLMLoss`` upcasts the logits to float), so agreement is within 1e-6 relative."""
    stock = copy.deepcopy(gpt_oss).double()
    stock.config._experts_implementation = "eager"
    model = copy.deepcopy(stock)
    registry = registry_with_ops(tmp_path, "linear-cross-entropy")
    (entry,) = [e for e in kernelize(model, mode="training", registry=registry).entries if e.op]
    assert entry.swapped and "router aux loss added as stock" in entry.swapped_to, entry
    (arch,) = [a for a in archs.architectures(("decoder",)) if a.model_type == "gpt_oss"]
    inputs = archs.batch(arch, model)
    labels = _labels(inputs)
    for routed in (True, False):
        got = model(**inputs, labels=labels, output_router_logits=routed)
        got.loss.backward()
        want = stock(**inputs, labels=labels, output_router_logits=routed)
        want.loss.backward()
        assert got.logits is None and (want.aux_loss is not None) == routed
        if routed:
            torch.testing.assert_close(got.aux_loss, want.aux_loss, rtol=0, atol=0)
        torch.testing.assert_close(got.loss.double(), want.loss.double(), rtol=1e-6, atol=0)
        mine, theirs = _grads(model), _grads(stock)
        assert mine.keys() == theirs.keys()
        for name, grad in theirs.items():
            error = float((mine[name] - grad).abs().max() / grad.abs().max())
            assert error <= 1e-6, f"{name}: relative max error {error:.3g}"
    # a model whose probe saw no aux_loss (policy None) runs a call that returns one stock
    model.__dict__[causal_lm_loss._STATE].aux = None
    got = model(**inputs, labels=labels)
    assert got.logits is not None
    torch.testing.assert_close(got.loss, stock(**inputs, labels=labels).loss, rtol=0, atol=0)
    assert unkernelize(model)


def _near_miss(variant: str) -> type:
    """GPT-OSS's causal LM forward, one detail changed by ``variant`` (or none: "stock")."""
    from transformers import GptOssForCausalLM
    from transformers.modeling_outputs import MoeCausalLMOutputWithPast
    from transformers.modeling_utils import slice_logits_to_keep
    from transformers.models.gpt_oss.modeling_gpt_oss import load_balancing_loss_func

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        labels=None,
        logits_to_keep=0,
        output_router_logits=None,
        return_dict=None,
        **kwargs,
    ):
        routed = output_router_logits
        routed = self.config.output_router_logits if routed is None else routed
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            output_router_logits=routed,
            **kwargs,
        )
        logits = self.lm_head(slice_logits_to_keep(out.last_hidden_state, logits_to_keep))
        loss = aux = None
        if labels is not None:
            loss = self.loss_function(logits, labels, self.vocab_size, **kwargs)
        if routed and (labels is not None or variant != "aux only with labels"):
            aux = load_balancing_loss_func(
                out.router_logits, self.num_experts, self.num_experts_per_tok, attention_mask
            )
            coef = self.router_aux_loss_coef
            if variant == "config's coefficient":
                coef = self.config.router_aux_loss_coef
            if labels is not None:
                loss = loss + coef * (aux * 2 if variant == "doubled aux" else aux)
        return MoeCausalLMOutputWithPast(loss=loss, aux_loss=aux, logits=logits)

    return type("NearMissForCausalLM", (GptOssForCausalLM,), {"forward": forward})


@pytest.mark.parametrize(
    "variant", ["config's coefficient", "aux only with labels", "doubled aux", "stock"]
)
def test_router_aux_loss_near_misses_are_refused(gpt_oss, variant: str) -> None:
    model = copy.copy(gpt_oss)
    model.__class__ = _near_miss(variant)
    if variant == "stock":  # the harness itself is served: the near misses differ in one detail
        assert probe(model) == ("model", LogitForm(), True)
        return
    with pytest.raises(Refused, match="adds or changes something the fused loss does not"):
        probe(model)


def test_a_multiplier_other_than_its_config_is_refused() -> None:
    model = _build("falcon_h1", lm_head_multiplier=0.5)
    model.model.lm_head_multiplier = 0.25
    with pytest.raises(Refused, match="post-processed in a way the kernel does not implement"):
        probe(model)
