"""docs/model-bench.md's table of real-size rows against the JSONs that reproduce them: each
variant a JSON in benchmarks/results/model-bench/ holds has a row whose figures are the JSON's,
rounded to the digits the row shows. A re-measured JSON whose row was not updated fails here."""

from __future__ import annotations

import json

import pytest
from doc_snippets import ROOT

RESULTS = ROOT / "benchmarks" / "results" / "model-bench"
TABLE = ROOT / "docs" / "model-bench.md"
# the table's figure columns, after preset, mode, tpu and variant, and the JSON value of each
FIGURES = (
    ("peak HBM GiB", lambda r: r["peak_hbm_bytes"] / 2**30),
    ("GB accessed", lambda r: r["bytes_accessed"] / 1e9),
    ("TFLOP", lambda r: r["flops"] / 1e12),
    ("roofline ms", lambda r: r["roofline_ms"]),
    ("min GB (hand)", lambda r: r["min_bytes"] / 1e9),
)


def _table_rows() -> list[list[str]]:
    rows = []
    for line in TABLE.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 4 + len(FIGURES):
            rows.append(cells)
    return rows


def _shows(cell: str, value: float) -> bool:
    """Whether a cell such as `1,947` or `58.20` is `value` rounded to the digits it shows."""
    text = cell.replace(",", "")
    try:
        shown = float(text)
    except ValueError:
        return False
    decimals = len(text.partition(".")[2])
    return abs(shown - value) <= 0.5 * 10.0**-decimals * (1 + 1e-9)


def _records() -> list[tuple[str, dict]]:
    return [
        (f"{path.name}:{record['variant']}", record)
        for path in sorted(RESULTS.glob("*.json"))
        for record in json.loads(path.read_text())
        if record.get("peak_hbm_bytes") is not None  # a variant libtpu refused has no figures
    ]


ROWS, RECORDS = _table_rows(), _records()  # read once for every case


def test_the_table_has_rows_to_check() -> None:
    assert len(ROWS) > 40 and len(RECORDS) > 40


@pytest.mark.parametrize("record", [r for _, r in RECORDS], ids=[i for i, _ in RECORDS])
def test_every_measured_variant_has_its_row(record: dict) -> None:
    matches = [
        cells
        for cells in ROWS
        if cells[0] == record["model"]
        and cells[1].startswith(record["mode"])
        and cells[2].startswith(record["tpu"])
        and cells[3].startswith(record["variant"])
        and all(
            _shows(cell, value(record)) for cell, (_, value) in zip(cells[4:], FIGURES, strict=True)
        )
    ]
    assert matches, (
        f"no row of {TABLE.name} shows {record['model']} {record['mode']} {record['tpu']} "
        f"{record['variant']}: "
        + ", ".join(f"{name} {value(record):.4g}" for name, value in FIGURES)
    )


def _table_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("model_bench_table", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SCRIPT = ROOT / "scripts" / "model_bench_table.py"


def test_the_table_script_runs_every_command_the_docs_give_and_each_parses() -> None:
    """scripts/model_bench_table.py reads the table's commands from the docs: every one is a
    model-bench command the CLI accepts, each writes its own JSON, and the presets are those
    of the table's JSONs."""
    from kernel_hub.cli import build_parser

    script = _table_script()
    commands = script.table_commands(TABLE.read_text())
    block = TABLE.read_text().split(script.SECTION, 1)[1].split("```bash", 1)[1].split("```")[0]
    assert len(commands) == block.count("kernel-hub model-bench ") > 40
    names = [script.json_name(args) for args in commands]
    assert len(set(names)) == len(names)  # no command overwrites another's JSON
    parser = build_parser()
    for args in commands:
        parsed = parser.parse_args(["model-bench", *args])
        assert parsed.json is None and parsed.preset
    assert {args[0] for args in commands} == {record["model"] for _, record in RECORDS}


def test_the_table_script_lists_and_filters_without_running(capsys) -> None:
    script = _table_script()
    assert script.main(["unused-dir", "--dry-run", "--only", "flux-1-dev"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert listed and all(line.startswith("kernel-hub model-bench flux-1-dev ") for line in listed)
