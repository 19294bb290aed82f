"""docs/coverage.md is a generated table (``kernel-hub models --markdown``); a fresh run of a
sample of its architectures must give the same rows, so a kernel or integration change that
alters what gets swapped (or why not) fails here until the table is regenerated."""

from __future__ import annotations

import pytest
import transformers
from doc_snippets import ROOT

from kernel_hub.cli.models_cmds import result_rows

from .coverage_runs import coverage_results

COVERAGE = ROOT / "docs" / "coverage.md"
# attention sinks, MLA, T5 position bias, MoE experts, an encoder with LayerNorm, plain Llama
SAMPLE = ("gpt_oss", "deepseek_v3", "t5", "mixtral", "bert", "llama")
COMPARED = {0: "model type", 1: "family", 2: "status", 3: "swapped", 6: "left alone / failed"}
"""Columns compared; the float differences (4, 5) vary with the host's float libraries."""


def _table() -> dict[str, list[str]]:
    rows = [line for line in COVERAGE.read_text().splitlines() if line.startswith("| ")]
    cells = [[c.strip().replace("\\|", "|") for c in row[1:-1].split(" | ")] for row in rows[1:]]
    return {row[0]: row for row in cells}


def test_generated_with_the_installed_transformers() -> None:
    header = COVERAGE.read_text().splitlines()[2]
    assert f"with transformers {transformers.__version__};" in header, (
        "regenerate: kernel-hub models --markdown > docs/coverage.md"
    )


@pytest.mark.slow
def test_sample_rows_match_a_fresh_run() -> None:
    table = _table()
    fresh = {row[0]: row for row in result_rows(coverage_results("inference", SAMPLE))}
    for model_type in SAMPLE:
        recorded, now = table[model_type], fresh[model_type]
        for column, name in COMPARED.items():
            assert recorded[column] == now[column], (
                f"docs/coverage.md is stale for {model_type} ({name}): {recorded[column]!r} "
                f"!= {now[column]!r}; regenerate: kernel-hub models --markdown > docs/coverage.md"
            )
