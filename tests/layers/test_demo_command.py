"""``kernel-hub demo``: table and JSON output, picking up attention/MoE kernels, errors."""

from __future__ import annotations

import json

import pytest
import torch

from kernel_hub import load_registry
from kernel_hub.cli import main
from kernel_hub.errors import UnknownNameError
from kernel_hub.models.demo import run_demo

from .kernelize_helpers import TOLERANCE, TmpHub


def expected_swaps(model: str) -> dict[str, int]:
    """What the in-tree registry's kernels swap in the tiny demo models (2 layers each)."""
    registry = load_registry()
    swaps = {"GatedMLP": 2} if model == "llama" and "gated-mlp" in registry else {}
    swaps["RMSNorm"] = 5
    if "attention" in registry:
        swaps["AttentionInterface"] = 2
    if model == "mixtral" and "moe-gemm" in registry:
        swaps["ExpertsInterface"] = 2
    if "ragged-attention" in registry:
        swaps["ContinuousBatching"] = 2
    return swaps


def test_demo_table(capsys: pytest.CaptureFixture) -> None:
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    threads, _blank, header, _rule, *rows = out.splitlines()
    assert threads.startswith("torch threads: 1;")
    assert header.split()[:3] == ["model", "swapped", "left"]
    for row, (cls, model) in zip(
        rows, [("LlamaForCausalLM", "llama"), ("MixtralForCausalLM", "mixtral")], strict=False
    ):
        swapped = ", ".join(f"{name} x{count}" for name, count in expected_swaps(model).items())
        assert row.startswith(f"{cls}  ") and f" {swapped} " in row, row
        assert row.rstrip().endswith("ok"), row


def test_demo_json(capsys: pytest.CaptureFixture) -> None:
    threads = torch.get_num_threads()
    assert main(["demo", "--json", "--model", "llama", "--threads", "2"]) == 0
    assert torch.get_num_threads() == threads
    (row,) = json.loads(capsys.readouterr().out)
    assert row["model"] == "LlamaForCausalLM" and row["ok"] and row["torch_threads"] == 2
    assert row["swapped"] == expected_swaps("llama")
    assert 0 <= row["max_logit_diff"] <= TOLERANCE
    assert row["greedy_identical"] and row["unkernelize_restores"]
    assert row["stock_ms"] > 0 and row["kernelized_ms"] > 0
    # norms + attention modules, each for AttentionInterface and ContinuousBatching + MLPs
    assert len(row["report"]["entries"]) == 5 + 2 + 2 + row["swapped"].get("GatedMLP", 0)


def test_demo_picks_up_attention_and_moe_kernels(tmp_hub: TmpHub) -> None:
    (row,) = run_demo(["mixtral"], registry=tmp_hub.all_kinds_registry())
    assert row["swapped"] == {
        "RMSNorm": 5,
        "AttentionInterface": 2,
        "ExpertsInterface": 2,
        "ContinuousBatching": 2,
    }
    assert row["left_alone"] == 0 and row["ok"]


def test_demo_reports_a_failing_kernel(tmp_hub: TmpHub, capsys: pytest.CaptureFixture) -> None:
    tmp_hub.add_kernel(
        "rmsnorm",
        {
            "__init__.py": "from . import layers\n",
            "layers.py": """
                import torch

                class RMSNorm(torch.nn.Module):
                    def forward(self, hidden_states):
                        raise RuntimeError("kernel exploded")
                """,
        },
        layers=("RMSNorm",),
    )
    registry = tmp_hub.write_registry({"rmsnorm": {"layers": ["RMSNorm"]}})
    assert main(["demo", "--model", "llama", "--registry", str(registry)]) == 1
    assert "llama: error: RuntimeError: kernel exploded" in capsys.readouterr().out


def test_demo_bad_thread_count(capsys: pytest.CaptureFixture) -> None:
    assert main(["demo", "--threads", "-1"]) == 2
    assert "--threads must be 0 (torch's default) or more, got -1" in capsys.readouterr().err


def test_demo_unknown_model() -> None:
    with pytest.raises(UnknownNameError, match="Valid demo models: llama, mixtral, qwen3_moe"):
        run_demo(["gpt2"])
