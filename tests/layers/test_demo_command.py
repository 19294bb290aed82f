"""``kernel-hub demo``: table and JSON output, picking up attention/MoE kernels, errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from kernel_hub import load_registry
from kernel_hub.cli import main
from kernel_hub.cli.demo_cmds import CPU_TIMING_NOTE
from kernel_hub.errors import UnknownNameError
from kernel_hub.models.demo import builds_label, run_demo
from kernel_hub.paths import kernels_dir

from .kernelize_helpers import TOLERANCE, TmpHub, declaring


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
    if "rotary" in registry:
        swaps["rotary_pos_emb"] = 2
    return swaps


def test_demo_table(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "1000")  # one line per row (narrower terminals wrap cells)
    assert main(["demo", "--no-hub"]) == 0
    out, err = capsys.readouterr()
    # progress on stderr as each model starts; what CPU times mean, after the table
    assert "demo: [1/2] llama: " in err and "demo: [2/2] mixtral: " in err
    assert out.rstrip().endswith(CPU_TIMING_NOTE)
    threads, _blank, header, _rule, *rows = out.splitlines()
    assert threads.startswith("torch threads: 1;")
    assert header.split()[:4] == ["model", "builds", "swapped", "left"]
    for row, (cls, model) in zip(
        rows, [("LlamaForCausalLM", "llama"), ("MixtralForCausalLM", "mixtral")], strict=False
    ):
        swapped = ", ".join(f"{name} x{count}" for name, count in expected_swaps(model).items())
        assert row.split()[:2] == [cls, "in-tree"] and f" {swapped} " in row, row
        assert row.rstrip().endswith("ok"), row


def test_demo_json(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    threads = torch.get_num_threads()
    # rmsnorm from a local directory: the row says so (labelled by where kernels came from)
    monkeypatch.setenv("KERNEL_HUB_LOCAL_KERNELS", f"rmsnorm={kernels_dir() / 'rmsnorm'}")
    assert main(["demo", "--json", "--no-hub", "--model", "llama", "--threads", "2"]) == 0
    assert torch.get_num_threads() == threads
    (row,) = json.loads(capsys.readouterr().out)
    assert row["model"] == "LlamaForCausalLM" and row["ok"] and row["torch_threads"] == 2
    origins = row["report"]["origins"]
    assert origins.pop("rmsnorm") == "local" and set(origins.values()) == {"in-tree"}
    assert row["builds"] == f"local: rmsnorm; in-tree: {', '.join(sorted(origins))}"
    assert row["swapped"] == expected_swaps("llama")
    assert 0 <= row["max_logit_diff"] <= TOLERANCE
    assert row["greedy_identical"] and row["unkernelize_restores"]
    assert row["stock_ms"] > 0 and row["kernelized_ms"] > 0
    # norms + attention modules, each for AttentionInterface, ContinuousBatching and the rotary
    # slot + MLPs
    slots = row["swapped"].get("rotary_pos_emb", 0)
    assert len(row["report"]["entries"]) == 5 + 2 + 2 + slots + row["swapped"].get("GatedMLP", 0)


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
            "__init__.py": declaring(layers=("RMSNorm",)),
            "layers.py": """
                import torch

                class RMSNorm(torch.nn.Module):
                    has_backward = True
                    can_torch_compile = False

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
    with pytest.raises(
        UnknownNameError, match="Valid demo models: llama, llama4_text, mistral, mixtral, qwen3_moe"
    ):
        run_demo(["gpt2"])


@pytest.mark.slow
def test_demo_runs_the_hub_round_trip_offline(tmp_path) -> None:
    """The main job as a user runs it: a fresh process, the hub half on 127.0.0.1 only."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "KERNEL_HUB_"))}
    env.update(HF_HOME=str(tmp_path / "hf-home"), HF_HUB_OFFLINE="0")
    done = subprocess.run(
        [sys.executable, "-P", "-m", "kernel_hub.cli", "demo", "--json"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout)
    registry = load_registry()
    published = [b["op"] for b in result["hub_builds"]]
    assert sorted(published) == sorted(registry.ops) and not result["not_published"]
    assert "rmsnorm" in published  # the op every demo model swaps
    for build in result["hub_builds"]:
        assert build["repo"] == f"kernel-hub-demo/{build['op']}" and build["variant"] == "torch-cpu"
        assert len(build["commit"]) == 40 and build["signed_by"].startswith("ed25519:")
    rows = result["rows"]
    assert [r["builds"] for r in rows[:2]] == ["in-tree", "in-tree"]
    for row in rows[2:]:  # labelled by where each swapped op's kernel came from
        used = sorted(row["report"]["origins"])
        assert set(used) <= set(published) and set(row["report"]["origins"].values()) == {"hub"}
        assert row["builds"] == "hub: " + ", ".join(used)
    assert len(rows) == 4 and all(r["ok"] for r in rows)
    # kernelize asked for each published op by version range, which only a hub build satisfies:
    # a failed fetch or verification would leave the layers alone instead
    for in_tree, hub, model in zip(rows[:2], rows[2:], ("llama", "mixtral"), strict=True):
        assert hub["swapped"] == in_tree["swapped"] == expected_swaps(model)


def test_builds_label_names_each_source_with_its_ops() -> None:
    assert builds_label({"rmsnorm": "in-tree", "attention": "in-tree"}) == "in-tree"
    assert builds_label({}) == "none"
    mixed = {"rotary": "in-tree", "rmsnorm": "hub", "attention": "hub", "gated-mlp": "local"}
    assert builds_label(mixed) == "hub: attention, rmsnorm; local: gated-mlp; in-tree: rotary"
