"""``kernel-hub model-bench`` end to end on one small cell: a narrow Llama, stock and kernelized,
traced through torchax and compiled deviceless for v6e.

torchax renames torch's PrivateUse1 device for the rest of a process, so the command runs in a
subprocess; the real-size cells are in docs/model-bench.md.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from kernel_hub.cli import main
from kernel_hub.models.presets import PRESETS

pytestmark = pytest.mark.tpu_compile

# Narrow but tile-aligned (head_dim 128, 2 query heads per KV head), vocab a multiple of the
# linear-cross-entropy block; 3 layers in the model, 2 compiled.
SMALL_LLAMA = {
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "num_hidden_layers": 3,
    "tie_word_embeddings": False,
}
TRAIN_KERNELS = {
    "flash_attention",
    "rms_norm",
    "rotary",
    "gated_activation",
    "linear_cross_entropy",
}


def model_bench(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    out = tmp_path / "out.json"
    settings = [f"--set={key}={json.dumps(value)}" for key, value in SMALL_LLAMA.items()]
    command = [sys.executable, "-m", "kernel_hub.cli", "model-bench", "--model-type=llama"]
    result = subprocess.run(
        [*command, *settings, *args, "--tpu=v6e", f"--json={out}"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result, json.loads(out.read_text())


@pytest.fixture(scope="module")
def train(tmp_path_factory):
    if importlib.util.find_spec("torchax") is None or importlib.util.find_spec("libtpu") is None:
        pytest.skip("model-bench needs torchax and libtpu (the torchax and tpu extras)")
    return model_bench(tmp_path_factory.mktemp("train"), "--mode=train", "--seq=128")


def test_both_variants_at_full_depth(train):
    _, rows = train
    assert [r["variant"] for r in rows] == ["stock", "kernelized"]
    for row in rows:
        assert (row["model"], row["mode"], row["tpu"]) == ("llama", "train", "v6e")
        assert (row["compiled_layers"], row["full_layers"]) == (2, 3)
        assert row["flops"] > 0 and row["bytes_accessed"] > 0 and row["roofline_ms"] > 0
        # three layers hold more than the two compiled
        assert row["peak_hbm_bytes"] > row["compiled"]["peak_hbm_bytes"]
        assert row["measured_ms"] is None  # no TPU here
    # same weights, same gradients: the arguments and outputs are the same size
    stock, kernelized = (r["compiled"] for r in rows)
    assert stock["argument_bytes"] == kernelized["argument_bytes"]
    assert stock["output_bytes"] == kernelized["output_bytes"]


def test_the_kernelized_program_holds_the_training_kernels(train):
    stock, kernelized = train[1]
    assert stock["kernels"] == [] and stock["replaced"] == {}
    for family in TRAIN_KERNELS:
        assert any(name.startswith(family) for name in kernelized["kernels"]), family
    assert kernelized["replaced"]["ForCausalLMLoss"] == "linear-cross-entropy x1"
    assert kernelized["replaced"]["GatedMLP"] == "gated-mlp x2"
    assert any("declared CostEstimate" in note for note in kernelized["notes"])


def test_the_table_names_both_variants(train):
    result, _ = train
    assert "stock" in result.stdout and "kernelized" in result.stdout
    assert "replaced RMSNorm -> rmsnorm x5" in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["llama-3-8b", "--layers=1"], "--layers must be >= 2"),
        (["llama-3-8b", "--layers=40"], "more than the model's 32 layers"),
        (["llama-9"], "unknown model preset 'llama-9'"),
        ([], "exactly one of PRESET"),
        (["--model-type=llama", "--set=tie_word_embeddings=maybe"], "cannot build a 'llama'"),
    ],
)
def test_bad_input_is_refused_before_any_compile(args, message, capsys):
    # in this process: each is refused before torchax is imported or anything compiles
    assert main(["model-bench", *args, "--mode=train", "--tpu=v6e"]) == 2
    assert message in capsys.readouterr().err


def test_decode_is_not_offered():
    with pytest.raises(SystemExit):
        main(["model-bench", "llama-3-8b", "--mode=decode", "--tpu=v6e"])


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_builds_at_real_width_on_meta(name):
    from kernel_hub.models.model_bench import _build, spec_for_preset

    spec = spec_for_preset(name, mode="train", tpu="v6e")
    model = _build(spec, 2)
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert model.config.hidden_size == PRESETS[name].config["hidden_size"]
    assert len(model.model.layers) == 2
