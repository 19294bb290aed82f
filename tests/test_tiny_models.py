"""``kernel_hub.models.tiny``: the one place tests build their tiny Transformers models."""

from __future__ import annotations

from pathlib import Path

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


def test_tiny_model_command_writes_a_checkpoint_from_pretrained_loads_offline(
    tmp_path, capsys, monkeypatch
):
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kernel_hub.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    target = tmp_path / "tiny-llama"
    assert main(["tiny-model", "llama", str(target), "--seed", "3", "--json"]) == 0
    written = json.loads(capsys.readouterr().out)
    assert written["model_class"] == "LlamaForCausalLM" and written["tokenizer"] is True
    names = {Path(f).name for f in written["files"]}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names, names

    tokenizer = AutoTokenizer.from_pretrained(target)
    text = "The capital of France is"
    batch = tokenizer([text, "Hi"], padding=True, return_tensors="pt")
    assert tokenizer.decode(batch.input_ids[0]) == text  # one token a character, no <unk>
    assert batch.attention_mask[1].tolist()[: len(text) - 2] == [0] * (len(text) - 2)  # left pad
    assert int(batch.input_ids.max()) < TINY_SIZES["vocab_size"]
    loaded = AutoModelForCausalLM.from_pretrained(target).eval()
    built = build_tiny_model("llama", seed=3)
    with torch.no_grad():
        got = loaded(**batch).logits
        torch.testing.assert_close(got, built(**batch).logits, rtol=0, atol=0)
    assert loaded.config.pad_token_id == tokenizer.pad_token_id


def test_tiny_model_command_refuses_an_unknown_arch_and_a_used_directory(tmp_path, capsys):
    from kernel_hub.cli import main

    assert main(["tiny-model", "lama", str(tmp_path / "new")]) == 2
    err = capsys.readouterr().err
    assert "unknown tiny model 'lama'. Did you mean 'llama'" in err
    assert "Valid tiny models: gemma3, llama, llama4_text, mistral, mixtral" in err
    assert not (tmp_path / "new").exists()
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "notes.txt").write_text("mine")
    assert main(["tiny-model", "llama", str(tmp_path / "used")]) == 2
    assert "used is not empty: give a new or empty directory" in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "used").iterdir()] == ["notes.txt"]


def test_tiny_model_command_writes_no_tokenizer_for_a_model_a_text_tokenizer_cannot_feed(
    tmp_path, capsys
):
    from transformers import ModernBertForMaskedLM

    from kernel_hub.cli import main

    assert main(["tiny-model", "modernbert", str(tmp_path / "mb")]) == 0
    out = capsys.readouterr().out
    assert "load it with transformers.ModernBertForMaskedLM.from_pretrained(" in out
    assert "AutoTokenizer" not in out and not (tmp_path / "mb" / "tokenizer.json").exists()
    loaded = ModernBertForMaskedLM.from_pretrained(tmp_path / "mb")
    built = build_tiny_model("modernbert").state_dict()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, built[name]), name
