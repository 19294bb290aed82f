"""``kernel-hub bench`` on this CPU: JSON, hand-counted cost, plot, errors."""

import json
import statistics
import subprocess
import sys

import numpy as np
import pytest

from kernel_hub.bench.harness import _to_torch
from kernel_hub.bench.plot import SHAPE_LABEL, SHARE_LABEL, TIME_LABEL, plot_results
from kernel_hub.cli import main

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TWO_SHAPES = "decode-b8-h4096,decode-b8-h4096-f32"


def hand_count(tokens, hidden, itemsize):
    """RMSNorm: per element square, mean-accumulate, scale by rsqrt, scale by weight; it reads
    x and the weight once and writes y once."""
    flops = 4 * tokens * hidden
    read_x = tokens * hidden * itemsize
    write_y = tokens * hidden * itemsize
    read_weight = hidden * itemsize
    return flops, read_x + write_y + read_weight


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    argv = [
        "bench",
        "rmsnorm",
        "--shapes",
        TWO_SHAPES,
        "--budget",
        "0.05",
        "--min-samples",
        "3",
        "--json",
        str(out / "out.json"),
        "--plot",
        str(out / "out.png"),
        "--no-progress",
    ]
    code = main(argv)
    return code, json.loads((out / "out.json").read_text()), (out / "out.png").read_bytes()


def test_runs_every_implementation_on_both_shapes(bench_run):
    code, record, _ = bench_run
    assert code == 0
    cells = {(r["case"], r["implementation"]): r for r in record["results"]}
    for case in TWO_SHAPES.split(","):
        for impl in ("pallas", "xla", "torch", "torch-op"):
            assert cells[(case, impl)]["status"] == "ok", cells[(case, impl)]["reason"]
    assert cells[("decode-b8-h4096", "xla")]["dtype"] == "bfloat16"
    assert cells[("decode-b8-h4096-f32", "xla")]["dtype"] == "float32"


def test_cost_per_call_matches_hand_counts(bench_run):
    _, record, _ = bench_run
    expected = {
        "decode-b8-h4096": hand_count(8, 4096, 2),  # bf16
        "decode-b8-h4096-f32": hand_count(8, 4096, 4),
    }
    assert expected == {
        "decode-b8-h4096": (131_072, 139_264),
        "decode-b8-h4096-f32": (131_072, 278_528),
    }
    for result in record["results"]:
        assert (result["flops"], result["bytes_accessed"]) == expected[result["case"]]


def test_statistics_come_from_the_samples(bench_run):
    _, record, _ = bench_run
    chip = record["chip"]
    assert chip["measured"] and chip["peak_flops"] > 0
    for r in record["results"]:
        samples = r["samples_s"]
        assert len(samples) >= 3
        assert r["median_s"] == pytest.approx(statistics.median(samples))
        assert r["p10_s"] <= r["median_s"] <= r["p90_s"]
        assert r["compile_s"] > 0
        assert r["flops_per_s"] == pytest.approx(r["flops"] / r["median_s"])
        assert r["bytes_per_s"] == pytest.approx(r["bytes_accessed"] / r["median_s"])
        compute = r["flops_per_s"] / chip["peak_flops"]
        bandwidth = r["bytes_per_s"] / chip["memory_bandwidth"]
        assert r["roofline_share"] == pytest.approx(max(compute, bandwidth))


def test_record_says_how_to_reproduce_it(bench_run):
    _, record, _ = bench_run
    assert record["kind"] == "bench"
    assert record["command"].startswith("kernel-hub bench rmsnorm --shapes")
    assert record["machine"]["platform"] == "cpu"
    assert record["versions"]["jax"] and record["versions"]["torch"]


def test_plot_is_a_png_with_labelled_axes(bench_run):
    _, record, png = bench_run
    assert png.startswith(PNG_SIGNATURE) and len(png) > 10_000
    figure = plot_results(record["results"])
    time_axes, share_axes = figure.axes
    assert time_axes.get_ylabel() == TIME_LABEL
    assert share_axes.get_ylabel() == SHARE_LABEL
    assert share_axes.get_xlabel() == SHAPE_LABEL
    ticks = [t.get_text() for t in share_axes.get_xticklabels()]
    assert ticks == ["decode-b8-h4096\n(bfloat16)", "decode-b8-h4096-f32\n(float32)"]
    legend = [t.get_text() for t in time_axes.get_legend().get_texts()]
    assert legend == ["pallas", "xla", "torch", "torch-op"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--impl", "triton"], "unknown implementation of rmsnorm 'triton'"),
        (["--shapes", "prefill-9k"], "unknown case 'prefill-9k'"),
        (["--dtype", "f16"], "Valid dtypes: bfloat16, float32"),
        (["--budget", "0"], "timing budget must be > 0"),
    ],
)
def test_bad_options_say_what_is_valid(flags, message, capsys):
    assert main(["bench", "rmsnorm", "--no-progress", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err


def test_no_op_named(capsys):
    assert main(["bench"]) == 2
    assert "name at least one op" in capsys.readouterr().err


def test_harness_applies_the_bridge_thread_policy_before_starting_jax():
    """Otherwise torch-op rows would time JAX's async CPU dispatch, which users never get."""
    child = (
        "import jax; from kernel_hub.bench.harness import run_benchmarks; "
        "run_benchmarks([], command='test'); "
        "print(jax.config.read('jax_cpu_enable_async_dispatch'))"
    )
    result = subprocess.run(
        [sys.executable, "-P", "-c", child], capture_output=True, text=True, timeout=300, check=True
    )
    assert result.stdout.split()[-1] == "False"


def test_torch_rows_get_torch_owned_aligned_tensors():
    """numpy's 16-byte alignment would make JAX copy each input of a bridged call."""
    for dtype in (np.float32, np.float64):
        host = np.ones((8, 4096), dtype)
        tensor = _to_torch(host, "cpu")
        assert tensor.data_ptr() % 64 == 0 and not np.shares_memory(tensor.numpy(), host)
