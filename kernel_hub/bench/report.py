"""Tables from recorded benchmark and compile-matrix JSON, and the generator of
``benchmarks/README.md``.

The CLI prints its tables with the same row functions, so the terminal and the README agree.

    python -m kernel_hub.bench.report           # rewrite benchmarks/README.md from results/*.json
    python -m kernel_hub.bench.report --check   # exit 1 if the README is out of date
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kernel_hub.errors import SourceError

from .overflow import MemoryOverflow
from .roofline import CHIPS

BENCHMARKS_DIR = Path("benchmarks")  # run from a kernel-hub checkout

BENCH_HEADERS = (
    "op",
    "case",
    "dtype",
    "impl",
    "median",
    "p10-p90",
    "compile",
    "GFLOP/s",
    "GB/s",
    "roofline",
)


def format_seconds(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def _format_rate(value: float | None, scale: float) -> str:
    return "-" if value is None else f"{value / scale:.3g}"


def _format_share(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f} %"


def _short(text: str | None, width: int = 70) -> str:
    line = (text or "").strip().splitlines()[0] if text else ""
    return line if len(line) <= width else line[: width - 3] + "..."


def bench_row(result: Mapping[str, Any]) -> list[str]:
    """One result (as in the JSON) as table cells, in ``BENCH_HEADERS`` order."""
    head = [result["op"], result["case"], result["dtype"], result["implementation"]]
    if result["status"] != "ok":
        return [*head, f"{result['status']}: {_short(result['reason'])}", *["-"] * 5]
    spread = f"{format_seconds(result['p10_s'])} - {format_seconds(result['p90_s'])}"
    return [
        *head,
        format_seconds(result["median_s"]),
        spread,
        format_seconds(result["compile_s"]),
        _format_rate(result["flops_per_s"], 1e9),
        _format_rate(result["bytes_per_s"], 1e9),
        _format_share(result["roofline_share"]),
    ]


def compile_cell(result: Mapping[str, Any]) -> str:
    """'ok 0.13 s', 'FAIL (VMEM 198.0 MiB > 128.0 MiB)', 'FAIL (HBM ...)', 'FAIL' or 'skip' for
    one compile result."""
    status = result["status"]
    if status == "pass":
        return f"ok {result['seconds']:.2f} s"
    if status == "skip":
        return "skip"
    overflow = result.get("overflow")
    if overflow:
        return f"FAIL ({MemoryOverflow(**overflow)})"
    return "FAIL (VMEM)" if result.get("vmem_overflow") else "FAIL"


COMPILE_KEY = ("kernel", "implementation", "case", "dtype", "direction")


def compile_table(
    results: Sequence[Mapping[str, Any]],
) -> tuple[list[str], list[list[str]]]:
    """Headers and rows of a compile matrix: one row per kernel/impl/case/direction, one column
    per TPU generation."""
    generations = list(dict.fromkeys(r["generation"] for r in results))
    rows: dict[tuple, dict[str, str]] = {}
    for result in results:
        key = tuple(result[k] for k in COMPILE_KEY)
        rows.setdefault(key, {})[result["generation"]] = compile_cell(result)
    headers = [*COMPILE_KEY, *generations]
    table = [[*key, *(cells.get(g, "-") for g in generations)] for key, cells in rows.items()]
    return headers, table


def compile_failures(results: Sequence[Mapping[str, Any]]) -> list[str]:
    """'kernel impl case direction generation: message' for each failed cell."""
    return [
        f"{r['kernel']} {r['implementation']} {r['case']} {r['direction']} {r['generation']}: "
        f"{_short(r['error'], 300)}"
        for r in results
        if r["status"] == "fail"
    ]


def _markdown(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    escape = lambda cell: str(cell).replace("|", "\\|")
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(escape(c) for c in row) + " |" for row in rows]
    return lines


def _versions(record: Mapping[str, Any]) -> str:
    versions = ", ".join(f"{k} {v}" for k, v in record["versions"].items() if v is not None)
    source = record.get("source")
    if source:
        versions += f"; kernel-hub commit {source['commit'][:12]}"
        versions += " with uncommitted changes" if source["dirty"] else ""
    return versions


def _bench_section(path: Path, record: Mapping[str, Any]) -> list[str]:
    machine = record["machine"]
    chip = record["chip"]
    lines = [
        f"### {path.name}",
        "",
        f"- command: `{record['command']}`",
        f"- created: {record['created']}; machine: {machine['device_kind']} "
        f"({machine['cpu_model']}, {machine['cpu_count']} CPUs, load average "
        f"{machine.get('load_average', '?')})",
        f"- versions: {_versions(record)}",
    ]
    if chip is not None:
        kind = "measured" if chip["measured"] else "published"
        lines.append(
            f"- roofline ({kind}): {chip['name']}, {chip['peak_flops'] / 1e9:.4g} GFLOP/s, "
            f"{chip['memory_bandwidth'] / 1e9:.4g} GB/s; {chip['source']}"
        )
    lines += ["", *_markdown(BENCH_HEADERS, [bench_row(r) for r in record["results"]])]
    plot = path.with_suffix(".png")
    if plot.is_file():
        lines += ["", f"![time and roofline share per case]({path.parent.name}/{plot.name})"]
    return lines


def _compile_section(path: Path, record: Mapping[str, Any]) -> list[str]:
    results = record["results"]
    counts = {s: sum(r["status"] == s for r in results) for s in ("pass", "fail", "skip")}
    lines = [
        f"### {path.name}",
        "",
        f"- command: `{record['command']}`",
        f"- created: {record['created']}; versions: {_versions(record)}",
        f"- {len(results)} cells: {counts['pass']} pass, {counts['fail']} fail, "
        f"{counts['skip']} skipped (implementation declines the shape)",
        "",
        *_markdown(*compile_table(results)),
    ]
    failures = compile_failures(results)
    if failures:
        lines += ["", "Failures:", "", *(f"- {f}" for f in failures)]
    return lines


def _chip_table() -> list[str]:
    rows = [
        [
            key,
            chip.name,
            f"{chip.peak_flops / 1e12:.4g}",
            f"{chip.memory_bandwidth / 1e9:.4g}",
            "-" if chip.vmem_bytes is None else f"{chip.vmem_bytes // 2**20}",
            chip.source,
        ]
        for key, chip in CHIPS.items()
    ]
    headers = ["key", "chip", "bf16 TFLOP/s", "HBM GB/s", "VMEM MiB/core", "source"]
    return _markdown(headers, rows)


_INTRO = """\
# Recorded benchmarks

Generated by `python -m kernel_hub.bench.report` from the JSON files in
[`results/`](results/); do not edit by hand. Every file holds the command that
produced it, the machine, library versions and every timing sample.

- `bench` files come from `kernel-hub bench`: median time per call after one
  warm-up call (synchronised), p10-p90 spread, compile time (JAX lower + compile;
  torch: first call), achieved GFLOP/s and GB/s from the case's declared FLOPs
  and bytes, and the share of the device's roofline:
  `max(FLOPs / peak FLOP/s, bytes / bandwidth) / time`, which equals the larger of
  the compute and bandwidth shares. On a CPU the roofline is measured on the spot
  (f32 matmul and copy probes); a working set that stays in the CPU caches can
  exceed 100 %. Pallas on a CPU runs in interpret mode: correct, not fast.
  `torch` is the stock torch path, `torch-op` kernel-hub's torch op.
- `compile` files come from `kernel-hub compile-check`: every kernel's TPU
  implementations compiled without a TPU (libtpu deviceless topologies), forward
  and backward, per generation; a cell is pass with its compile time, FAIL
  (with the memory that overflowed, HBM or VMEM, and the bytes asked and
  available) or skip.
- The benchmark scripts beside this file and the runs they recorded are listed
  at the end ("Benchmark scripts").
"""


def _scripts_section(benchmarks_dir: Path) -> list[str]:
    """Each benchmark script, what it measures (its docstring's first line) and the records it
    wrote beside it (``SCRIPT*.json``); results/ holds the CLI's records."""
    lines = []
    for script in sorted(benchmarks_dir.glob("*.py")):
        doc = ast.get_docstring(ast.parse(script.read_text())) or ""
        records = sorted(
            p.name
            for p in benchmarks_dir.glob("*.json")
            if p.stem == script.stem or p.stem.startswith(f"{script.stem}_")
        )
        recorded = ", ".join(f"[`{name}`]({name})" for name in records) or "prints only"
        lines.append(
            f"- [`{script.name}`]({script.name}): {doc.splitlines()[0] if doc else '-'} "
            f"Recorded: {recorded}."
        )
    return lines


def render_readme(results_dir: Path) -> str:
    """The README text for every ``*.json`` in ``results_dir`` (sorted by name, so by date within
    a machine kind), with the PNG plot beside a bench file when there is one."""
    bench, compiled = [], []
    for path in sorted(results_dir.glob("*.json")):
        record = json.loads(path.read_text())
        kind = record.get("kind")
        if kind == "bench":
            bench += ["", *_bench_section(path, record)]
        elif kind == "compile":
            compiled += ["", *_compile_section(path, record)]
        else:
            raise SourceError(path, None, f"unknown kind {kind!r}; expected 'bench' or 'compile'")
    lines = [_INTRO.rstrip(), "", "## Microbenchmarks", *bench, "", "## TPU compile matrix"]
    lines += [*compiled, "", "## Roofline figures of the chips", "", *_chip_table()]
    lines += ["", "## Benchmark scripts", "", *_scripts_section(results_dir.parent)]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kernel_hub.bench.report", description="Regenerate benchmarks/README.md."
    )
    parser.add_argument("--dir", type=Path, default=BENCHMARKS_DIR, help="benchmarks directory")
    parser.add_argument("--check", action="store_true", help="fail if the README is out of date")
    args = parser.parse_args(argv)
    readme = args.dir / "README.md"
    text = render_readme(args.dir / "results")
    if args.check:
        if not readme.is_file() or readme.read_text() != text:
            print(f"{readme} is stale; run python -m kernel_hub.bench.report", file=sys.stderr)
            return 1
        return 0
    readme.write_text(text)
    print(f"wrote {readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
