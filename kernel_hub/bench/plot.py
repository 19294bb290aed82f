"""PNG plot of a benchmark run: time and roofline share per shape and implementation.

Built on matplotlib's object API with the Agg canvas, so it needs no display and leaves pyplot's
global state alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

TIME_LABEL = "median time per call (ms, log scale)"
SHARE_LABEL = "roofline share (%)"
SHAPE_LABEL = "benchmark case (dtype)"


def plot_results(results: Sequence[Mapping[str, Any]], title: str = "") -> Any:
    """A figure with two panels over the cases: median time (bars, p10-p90 whiskers) and share
    of the roofline, one bar per implementation. ``results`` are JSON-shaped result dicts;
    results that did not run are left out."""
    from matplotlib.figure import Figure

    ran = [r for r in results if r["status"] == "ok"]
    ops = {r["op"] for r in ran}
    cases = list(dict.fromkeys((r["op"], r["case"], r["dtype"]) for r in ran))
    impls = list(dict.fromkeys(r["implementation"] for r in ran))
    by_cell = {(r["op"], r["case"], r["dtype"], r["implementation"]): r for r in ran}

    figure = Figure(figsize=(max(6.0, 1.1 * len(cases) * max(1, len(impls)) / 2 + 2), 7.5))
    time_axes, share_axes = figure.subplots(2, 1, sharex=True)
    width = 0.8 / max(1, len(impls))
    for index, impl in enumerate(impls):
        offset = (index - (len(impls) - 1) / 2) * width
        positions, medians, low, high, shares = [], [], [], [], []
        for position, case in enumerate(cases):
            cell = by_cell.get((*case, impl))
            if cell is None:
                continue
            positions.append(position + offset)
            medians.append(1e3 * cell["median_s"])
            low.append(1e3 * (cell["median_s"] - cell["p10_s"]))
            high.append(1e3 * (cell["p90_s"] - cell["median_s"]))
            share = cell["roofline_share"]
            shares.append(float("nan") if share is None else 100 * share)
        time_axes.bar(positions, medians, width, yerr=[low, high], capsize=2, label=impl)
        share_axes.bar(positions, shares, width, label=impl)

    time_axes.set_yscale("log")
    time_axes.set_ylabel(TIME_LABEL)
    time_axes.legend(title="implementation", fontsize="small")
    share_axes.axhline(100, color="black", linewidth=0.8, linestyle="--")  # the roofline itself
    share_axes.set_ylabel(SHARE_LABEL)
    share_axes.set_xlabel(SHAPE_LABEL)
    labels = [f"{op + ' ' if len(ops) > 1 else ''}{case}\n({dtype})" for op, case, dtype in cases]
    share_axes.set_xticks(range(len(cases)), labels, rotation=30, ha="right", fontsize="small")
    for axes in (time_axes, share_axes):
        axes.grid(axis="y", alpha=0.3)
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    return figure


def save_plot(results: Sequence[Mapping[str, Any]], path: str | Path, title: str = "") -> Any:
    """Write the plot as PNG; returns the figure."""
    figure = plot_results(results, title)
    figure.savefig(Path(path), format="png", dpi=110)
    return figure


def plot_model_bench(results: Sequence[Mapping[str, Any]]) -> Any:
    """Stock vs kernelized bars per model, mode and TPU: peak HBM and roofline time.
    ``results`` are model-bench JSON objects (``VariantResult.to_json``); a variant that does not
    fit one chip's HBM (figures null) is a label where its bar would be."""
    from matplotlib.figure import Figure

    cells = list(dict.fromkeys((r["model"], r["mode"], r["tpu"]) for r in results))
    variants = list(dict.fromkeys(r["variant"] for r in results))
    by_cell = {(r["model"], r["mode"], r["tpu"], r["variant"]): r for r in results}
    figure = Figure(figsize=(max(6.0, 1.6 * len(cells) + 2), 7.0))
    panels = figure.subplots(2, 1, sharex=True)
    metrics = (("peak_hbm_bytes", 2**30, "peak HBM (GiB)"), ("roofline_ms", 1, "roofline (ms)"))
    width = 0.8 / max(1, len(variants))
    for axes, (key, unit, label) in zip(panels, metrics, strict=True):
        for index, variant in enumerate(variants):
            offset = (index - (len(variants) - 1) / 2) * width
            present = [(i, by_cell.get((*c, variant))) for i, c in enumerate(cells)]
            present = [(i, r) for i, r in present if r is not None]
            bars = [(i, r) for i, r in present if r[key] is not None]
            axes.bar(
                [i + offset for i, _ in bars],
                [r[key] / unit for _, r in bars],
                width,
                label=variant,
            )
            for i in (i for i, r in present if r[key] is None):
                text = "does not fit\none chip's HBM"
                axes.text(i + offset, 0, text, rotation=90, ha="center", va="bottom")
        axes.set_xlim(-0.5, len(cells) - 0.5)  # a label is no artist the limits follow
        axes.set_ylabel(label)
        axes.grid(axis="y", alpha=0.3)
    panels[0].legend(fontsize="small")
    names = [f"{model}\n{mode} {tpu}" for model, mode, tpu in cells]
    panels[1].set_xticks(range(len(cells)), names, fontsize="small")
    figure.suptitle("kernel-hub model-bench (deviceless compiler model, full depth)")
    figure.tight_layout()
    return figure


def save_model_bench_plot(results: Sequence[Mapping[str, Any]], path: str | Path) -> Any:
    figure = plot_model_bench(results)
    figure.savefig(Path(path), format="png", dpi=110)
    return figure
