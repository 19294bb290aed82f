"""``kernel-hub models`` over a spread of the installed Transformers' architectures: every one
that kernelize swaps must match stock (1e-4, f32 outputs and training gradients) or it fails.

The selection is every ``STRIDE``-th architecture of the auto mappings (vision-language models
aside: two of them, fed images, stand for their family) plus the ones the issue named;
``docs/coverage.md`` has the full run.
"""

from __future__ import annotations

import math

import pytest
import torch

from kernel_hub.cli import main
from kernel_hub.models import architectures as archs
from kernel_hub.models import coverage
from kernel_hub.models.coverage import DEFECTS, EXACT, run_coverage, summary

from .coverage_runs import coverage_results

STRIDE = 4
NAMED = ("gpt_oss", "t5", "deepseek_v3", "llama", "gemma", "olmo2")
LEFT_ALONE_AT_KERNELIZE = {
    # (model type, mode) -> why its attention keeps the stock implementation (both were swapped,
    # then wrong: a [B, 1, 1, S] mask refused at call time; a parameter mask without gradient)
    ("layoutlm", "inference"): "builds its own broadcastable [B, 1, 1, S] attention mask",
    ("layoutlm", "training"): "builds its own broadcastable [B, 1, 1, S] attention mask",
    ("doge", "inference"): "computes its attention mask from parameters (prepare_dynamic_mask)",
    ("doge", "training"): "computes its attention mask from parameters (prepare_dynamic_mask)",
}


VISION_LANGUAGE = ("paligemma", "qwen2_vl")
"""Image-fed vision-language models: a prefix-LM image block, mRoPE positions."""


def _selection() -> list[str]:
    families = tuple(f for f in archs.FAMILIES if f != "image-text")
    found = [a.model_type for a in archs.architectures(families)]
    return sorted(set(found[::STRIDE]) | set(NAMED) | set(VISION_LANGUAGE))


def _check(mode: str) -> None:
    results = coverage_results(mode, _selection())
    ran = [r for r in results if r.ran]
    print(summary(results))  # with -s: the line recorded in the issue note
    assert len(ran) >= 40, summary(results)
    defects = {
        r.model_type: f"{r.status} {r.max_diff} {r.grad_rel_diff} {r.detail}"
        for r in results
        if r.status in DEFECTS
    }
    assert not defects, f"{summary(results)}\n{defects}"
    by_type = {r.model_type: r for r in results}
    for named in ("gpt_oss", "deepseek_v3", "llama", "gemma", "olmo2"):
        assert by_type[named].status == EXACT, by_type[named]
    assert by_type["t5"].status in (EXACT, "unchanged")


@pytest.mark.slow
def test_inference_coverage() -> None:
    _check("inference")


@pytest.mark.slow
def test_training_coverage() -> None:
    _check("training")


def test_models_command_json_and_unknown_names(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "--json", "--model-type", "llama"]) == 0
    assert '"status": "exact"' in capsys.readouterr().out
    assert main(["models", "--family", "nope"]) == 2
    assert "unknown family 'nope'" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["inference", "training"])
def test_attention_left_alone_where_it_would_be_wrong(mode: str) -> None:
    results = {r.model_type: r for r in run_coverage(mode, model_types=["layoutlm", "doge"])}
    for model_type, result in results.items():
        assert result.status == EXACT, result
        reasons = " ".join(e.reason for e in result.left_alone if e.target == "AttentionInterface")
        expected = LEFT_ALONE_AT_KERNELIZE.get((model_type, mode))
        if expected is None:
            assert "AttentionInterface" in result.swapped, result
        else:
            assert expected in reasons and "AttentionInterface" not in result.swapped, result


PERSIMMON_BIAS = "model.layers.1.self_attn.q_layernorm.bias"


def test_rounding_allowance_passes_conditioning_and_still_catches_defects() -> None:
    """Persimmon's q-LayerNorm bias gradient is ill-conditioned: stock runs moved by one rounding
    land ~1.4e-4 off f64 (the largest gradient: under 1e-5), the kernels 1.7e-4, and stock f32
    itself lands 8e-5 or 1.8e-4 off depending on the CPU's f32 kernels (AVX512 machines differ),
    so how stock f32 lands is not asserted. The kernels pass on the rounding runs' error; a 1%
    error on that gradient or on a well-conditioned one fails."""
    arch = next(a for a in archs.architectures() if a.model_type == "persimmon")
    model = archs.build(arch, archs.CONFIG_VARIANTS[0]).train()
    inputs = archs.batch(arch, model)
    stock = coverage._run(model, inputs, training=True)
    exact = coverage._exact_gradients(model, inputs, stock)
    largest = max(exact, key=lambda n: coverage._largest(exact[n]))
    rounding = coverage._rounding_errors(model, inputs, exact, [PERSIMMON_BIAS, largest])

    assert rounding[PERSIMMON_BIAS] > 10 * rounding[largest]  # ill- vs well-conditioned
    assert rounding[largest] < 1e-5  # the allowance is the problem's, not a blanket one
    for name in (PERSIMMON_BIAS, largest):
        off = {**stock.grads, name: stock.grads[name] * 1.01}
        assert coverage._check_gradients(exact, stock.grads, off, rounding).failing == (name,)
    assert not coverage._check_gradients(exact, stock.grads, stock.grads, rounding).failing
    # the parameters are restored after the rounding runs
    assert coverage._run(model, inputs, training=True).grads[largest].equal(stock.grads[largest])

    (result,) = run_coverage("training", model_types=["persimmon"])
    assert result.status == EXACT, result


def test_not_finite_gradients_fail_and_a_nan_f64_reference_is_not_used() -> None:
    """A NaN compares false with any tolerance: it must fail, not pass. Gemma 2's eager f64 run
    gives NaN gradients (fully masked padding rows add two f64 minima to -inf): stock f32 is the
    reference there, against which its kernels are within tolerance."""
    truth = {"w": torch.ones(3)}
    assert coverage._check_gradients(truth, truth, {"w": torch.full((3,), math.nan)}).failing
    arch = next(a for a in archs.architectures() if a.model_type == "gemma2")
    model = archs.build(arch, archs.CONFIG_VARIANTS[0]).train()
    inputs = archs.batch(arch, model)
    stock = coverage._run(model, inputs, training=True)
    assert coverage._exact_gradients(model, inputs, stock) is stock.grads
    (result,) = run_coverage("training", model_types=["gemma2"])
    assert result.status == EXACT and result.grad_rel_diff > 0, result


def test_depth_counts_swapped_modules_of_the_candidates_and_flagships_get_their_line() -> None:
    left = (coverage.LeftAlone("Gemma4RMSNorm", "RMSNorm", "why", 3),)
    gemma = coverage.Result(
        "gemma4_text", "decoder", "M", "inference", EXACT, {"RMSNorm": 6, "GatedMLP": 3}, left
    )
    other = coverage.Result("bert", "encoder", "M", "inference", EXACT, {"LayerNorm": 4})
    unbuilt = coverage.Result("llama", "decoder", "M", "inference", coverage.NOT_BUILT)
    assert (gemma.candidates, gemma.depth) == (12, 0.75)
    assert gemma.to_dict()["depth"] == 0.75 and unbuilt.depth is None
    line = coverage.flagship_summary([gemma, other, unbuilt])
    assert line == (
        f"flagships (1 of {len(coverage.FLAGSHIPS)} run): 9 of 12 candidate modules swapped, "
        "75% depth"
    )
    assert coverage.flagship_summary([other]) is None
