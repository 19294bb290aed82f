"""Recorded results under benchmarks/ and the README generated from them."""

import json
import shutil
import statistics
from pathlib import Path

import pytest

from kernel_hub.bench.report import main, render_readme

BENCHMARKS_DIR = Path(__file__).resolve().parents[2] / "benchmarks"

RECORDS = sorted((BENCHMARKS_DIR / "results").glob("*.json"))


def _load(path):
    return json.loads(path.read_text())


def test_there_are_benchmark_and_compile_records():
    kinds = {_load(path)["kind"] for path in RECORDS}
    assert kinds == {"bench", "compile"}


@pytest.mark.parametrize("path", RECORDS, ids=lambda p: p.name)
def test_record_states_its_command_and_environment(path):
    record = _load(path)
    command = {"bench": "kernel-hub bench ", "compile": "kernel-hub compile-check "}
    assert record["command"].startswith(command[record["kind"]])
    assert record["machine"]["cpu_count"] and record["versions"]["jax"]
    assert record["results"]


@pytest.mark.parametrize(
    "path", [p for p in RECORDS if _load(p)["kind"] == "bench"], ids=lambda p: p.name
)
def test_recorded_timings_derive_from_their_samples(path):
    record = _load(path)
    for r in record["results"]:
        if r["status"] != "ok":
            assert r["reason"]
            continue
        assert r["median_s"] == pytest.approx(statistics.median(r["samples_s"]))
        assert r["flops_per_s"] == pytest.approx(r["flops"] / r["median_s"])


def test_readme_is_generated_from_the_records():
    assert (BENCHMARKS_DIR / "README.md").read_text() == render_readme(BENCHMARKS_DIR / "results")


def test_check_flags_a_stale_readme(tmp_path, capsys):
    shutil.copytree(BENCHMARKS_DIR / "results", tmp_path / "results")
    (tmp_path / "README.md").write_text("old\n")
    assert main(["--dir", str(tmp_path), "--check"]) == 1
    assert main(["--dir", str(tmp_path)]) == 0
    assert main(["--dir", str(tmp_path), "--check"]) == 0
    assert "## TPU compile matrix" in (tmp_path / "README.md").read_text()
