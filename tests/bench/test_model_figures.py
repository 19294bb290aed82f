"""Model-bench arithmetic without a compile: depth scaling, the hand count, roofline, timing."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from kernel_hub.bench.model_figures import (
    ProgramFigures,
    has_loops,
    median_ms,
    model_bench_row,
    pallas_kernels,
    roofline_ms,
    scale_by_type,
    variant_result,
)
from kernel_hub.bench.roofline import TPU_CHIPS
from kernel_hub.errors import KernelInputError


def figures(layers: int) -> ProgramFigures:
    """A program whose every figure is a fixed part plus a per-layer part."""
    return ProgramFigures(
        argument_bytes=1000 + 300 * layers,
        output_bytes=10 + 3 * layers,
        temp_bytes=500 + 50 * layers,
        alias_bytes=0,
        bytes_accessed=7000 + 2000 * layers,
        flops=1e6 + 4e5 * layers,
    )


def test_scaling_from_two_compiles_gives_the_full_depth():
    grows = {"layers_keep_activations": True}
    assert scale_by_type(figures(1), {"decoder": figures(2)}, 1, {"decoder": 32}, **grows) == (
        figures(32)
    )
    assert scale_by_type(figures(3), {"decoder": figures(4)}, 3, {"decoder": 48}, **grows) == (
        figures(48)
    )


def two_types(sliding: int, full: int) -> ProgramFigures:
    """A program whose sliding layers cost less than its full ones."""
    one = figures(sliding + full)
    return one.plus(figures(1) - figures(0), full)  # a full layer costs two sliding ones


def test_scaling_by_layer_type_adds_each_types_own_layer_cost():
    base = two_types(1, 1)
    one_more = {"sliding": two_types(2, 1), "full": two_types(1, 2)}
    counts = {"sliding": 40, "full": 8}
    full = scale_by_type(base, one_more, 1, counts, layers_keep_activations=True)
    assert full == two_types(40, 8)


def test_a_forward_steps_temporaries_are_the_largest_compiled_peak_not_scaled():
    """Temporaries that jump from one compiled program to the next (the compiler's placement)
    are not multiplied by depth; everything else still scales."""
    base = two_types(1, 1)
    one_more = {
        "sliding": replace(two_types(2, 1), temp_bytes=base.temp_bytes + 900),
        "full": replace(two_types(1, 2), temp_bytes=base.temp_bytes - 40),
    }
    counts = {"sliding": 40, "full": 8}
    full = scale_by_type(base, one_more, 1, counts, layers_keep_activations=False)
    assert full.temp_bytes == base.temp_bytes + 900
    assert replace(full, temp_bytes=0) == replace(two_types(40, 8), temp_bytes=0)
    scaled = scale_by_type(base, one_more, 1, counts, layers_keep_activations=True)
    assert scaled.temp_bytes == base.temp_bytes + 39 * 900 - 7 * 40
    assert full.peak_hbm_bytes == scaled.peak_hbm_bytes - (39 * 900 - 7 * 40) + 900


_FORWARD = {"layers_keep_activations": False}


def test_scaling_needs_every_type_and_enough_layers_of_it():
    with pytest.raises(KernelInputError, match=r"compiled \(decoder\) are not the model's"):
        scale_by_type(figures(1), {"decoder": figures(2)}, 1, {"sliding": 4, "full": 1}, **_FORWARD)
    with pytest.raises(KernelInputError, match="1 full layers: scaling compiles 2"):
        scale_by_type(figures(1), {"full": figures(2)}, 1, {"full": 1}, **_FORWARD)


def test_peak_counts_aliased_outputs_once_and_min_bytes_reads_and_writes_once():
    program = ProgramFigures(100, 40, 7, 30, 0, 0)
    assert program.peak_hbm_bytes == 100 + 40 + 7 - 30
    # an output updating an argument in place (a donated cache) is moved once, not twice
    assert program.min_bytes == 110
    # a decode step's hand count: + the new tokens written, - the cache buffer's unused room
    assert ProgramFigures(100, 40, 7, 30, 0, 0, min_bytes_correction=-25).min_bytes == 85


def test_roofline_is_the_slower_of_compute_and_bandwidth():
    chip = TPU_CHIPS["v6e"]
    compute_bound = roofline_ms("v6e", flops=chip.peak_flops, bytes_accessed=1.0)
    bandwidth_bound = roofline_ms("v6e", flops=1.0, bytes_accessed=2 * chip.memory_bandwidth)
    assert compute_bound == pytest.approx(1e3)
    assert bandwidth_bound == pytest.approx(2e3)


def test_median_ms_times_only_after_warm_up_with_the_given_clock():
    calls = []
    ticks = itertools.count()
    durations = iter([5.0, 1.0, 3.0])  # seconds each timed call takes on the fake clock
    now = [0.0]

    def clock() -> float:
        next(ticks)
        return now[0]

    def run() -> None:
        calls.append(len(calls))
        if len(calls) > 2:  # the two warm-up calls take no fake time
            now[0] += next(durations)

    assert median_ms(run, warmup=2, repeats=3, clock=clock) == pytest.approx(3000.0)
    assert len(calls) == 5
    assert next(ticks) == 6  # start and stop read once per timed call


def test_median_ms_refuses_no_repeats():
    with pytest.raises(KernelInputError, match="repeats >= 1"):
        median_ms(lambda: None, repeats=0)


def test_kernel_names_and_loops_come_from_the_program_text():
    jaxpr = (
        "a = pallas_call[\n  grid=(4,)\n  name=rms_norm_forward\n] b\n"
        "c = pallas_call[name=flash_attention_forward grid=(2,)] d\n"
        "e = pallas_call[name=rms_norm_forward] f\n"
    )
    assert pallas_kernels(jaxpr) == ["flash_attention_forward", "rms_norm_forward"]
    assert pallas_kernels("dot_general[...]") == []
    assert has_loops("%w = (s32[]) while(%t), condition=%c, body=%b")
    assert not has_loops("%x = f32[8] add(%a, %b)")


def test_a_row_scales_says_so_and_flags_declared_costs_and_loops():
    result = variant_result(
        model="m",
        mode="train",
        tpu="v5e",
        variant="kernelized",
        base=figures(1),
        one_more={"decoder": figures(2)},
        per_type_in_base=1,
        counts={"decoder": 10},
        kernels=["rms_norm_forward"],
        replaced={"RMSNorm": "rmsnorm x5"},
        loops=True,
        layers_keep_activations=True,
    )
    full = figures(10)
    assert result.peak_hbm_bytes == full.peak_hbm_bytes
    assert result.min_bytes == full.min_bytes
    assert result.roofline_ms == roofline_ms("v5e", full.flops, full.bytes_accessed)
    assert result.compiled["flops"] == figures(2).flops
    notes = " ".join(result.notes)
    assert "scaled from 2 compiled decoder layers to 10" in notes
    assert "temporaries scaled with depth" in notes
    assert "declared CostEstimate (rms_norm_forward)" in notes
    assert "counts a loop body once" in notes
    keys = result.to_json().keys()
    for key in ("model", "mode", "tpu", "variant", "peak_hbm_bytes", "bytes_accessed", "flops"):
        assert key in keys
    assert {"roofline_ms", "kernels", "notes"} <= keys
    assert model_bench_row(result)[3] == "kernelized"
