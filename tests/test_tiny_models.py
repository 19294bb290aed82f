"""``kernel_hub.models.tiny``: the one place tests build their tiny Transformers models."""

from __future__ import annotations

import torch
from transformers import BertConfig, BertModel, LlamaConfig, MixtralForCausalLM

from kernel_hub.models.tiny import TINY_SIZES, build_tiny_model, tiny_config, tiny_model


def test_tiny_config_takes_the_shared_sizes_the_class_has_and_the_fields_given():
    llama = tiny_config(LlamaConfig, num_hidden_layers=1)
    assert llama.num_hidden_layers == 1 and llama.num_key_value_heads == 2
    assert llama.hidden_size == TINY_SIZES["hidden_size"]
    bert = tiny_config(BertConfig)
    assert bert.hidden_size == TINY_SIZES["hidden_size"]
    assert "num_key_value_heads" not in bert.to_dict(), "an encoder has no key/value head count"


def test_tiny_model_is_seeded_and_in_eval_mode():
    first, again = tiny_model(BertModel), tiny_model(BertModel)
    other = tiny_model(BertModel, seed=1)
    assert not first.training
    weights = [m.embeddings.word_embeddings.weight for m in (first, again, other)]
    assert torch.equal(weights[0], weights[1]) and not torch.equal(weights[0], weights[2])
    experts = tiny_model(MixtralForCausalLM, num_local_experts=4, num_experts_per_tok=2)
    assert experts.config.num_local_experts == 4


def test_demo_models_follow_their_seed():
    a, b = build_tiny_model("llama", seed=3), build_tiny_model("llama", seed=3)
    c = build_tiny_model("llama", seed=4)
    norm = [m.model.norm.weight for m in (a, b, c)]
    assert torch.equal(norm[0], norm[1]) and not torch.equal(norm[0], norm[2])
