"""torchax ("jax" device): tiny Llama and Mixtral with kernel-hub's layers against the stock CPU
model.

torchax renames torch's PrivateUse1 device and breaks torch.compile in any process that imports it,
so the checks run in one subprocess (torchax_checks.py) that prints a report per model; the
thresholds and what each model should show are here.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

TOLERANCE = 1e-4
SCRIPT = Path(__file__).with_name("torchax_checks.py")

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class Expected:
    """What one tiny model (kernel_hub.models.tiny: 2 decoder layers) shows on the jax device."""

    swapped_by_hand: dict[str, int]
    kernelize_swapped: dict[str, int]
    """Besides attention, which swaps only where its kernel loads."""
    params_by_kind: dict[str, int]
    """Out of 21 parameters, all with gradients compared."""
    kernels_in_training_step: tuple[str, ...]
    """Pallas kernels (by name) in the jitted training step's jaxpr."""
    min_forward_calls: dict[str, int]
    """Each kernel-hub op the model uses -> forward op calls at least seen."""


NORMS = 5  # 2 layers x 2 norms + the final norm
EXPECTED = {
    "llama": Expected(
        swapped_by_hand={"RMSNorm": NORMS},
        # 2 layers' MLPs (gated-mlp) and rotary slots (rotary)
        kernelize_swapped={"RMSNorm": NORMS, "GatedMLP": 2, "rotary_pos_emb": 2},
        params_by_kind={"norm": NORMS, "router": 0, "experts": 0},
        kernels_in_training_step=("rms_norm_backward", "rms_norm_forward"),
        min_forward_calls={"rms_norm": NORMS},
    ),
    "mixtral": Expected(
        swapped_by_hand={"RMSNorm": NORMS, "MoEExperts": 2},
        kernelize_swapped={"RMSNorm": NORMS, "ExpertsInterface": 2, "rotary_pos_emb": 2},
        # per layer: the router, and the experts' gate_up_proj and down_proj
        params_by_kind={"norm": NORMS, "router": 2, "experts": 4},
        kernels_in_training_step=("moe_gmm", "moe_tgmm", "rms_norm_backward", "rms_norm_forward"),
        # gmm: 2 per layer (gate_up, down); tgmm runs as an op of its own only in the op check
        # (inside the model it is part of gmm's backward).
        min_forward_calls={"rms_norm": NORMS, "gmm": 4, "tgmm": 1},
    ),
}


@pytest.fixture(scope="module")
def reports() -> dict[str, dict]:
    """Every model's report, from one subprocess (the models share their compiled programs)."""
    if importlib.util.find_spec("torchax") is None:
        pytest.skip("torchax is not installed (scripts/test.sh installs the pinned dev build)")
    result = subprocess.run(
        [sys.executable, str(SCRIPT), *EXPECTED],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, f"torchax checks failed:\n{result.stderr[-6000:]}"
    return json.loads(result.stdout.splitlines()[-1])


@pytest.fixture(scope="module", params=list(EXPECTED))
def report(request, reports) -> dict:
    return reports[request.param]


@pytest.fixture
def expected(report) -> Expected:
    return EXPECTED[report["model"]]


def test_model_runs_on_the_jax_device_with_every_layer_swapped(report, expected):
    assert report["swapped_layers"] == expected.swapped_by_hand
    assert report["logits_type"] == "Tensor"  # torchax.tensor.Tensor, not a CPU tensor


def test_kernelize_swaps_the_layers_on_the_jax_device(report, expected):
    swapped = dict(report["kernelize_swapped"])
    assert report["kernelize_device"] == "jax"
    # With the attention kernel loadable here (tokamax installed), its two modules swap too.
    assert swapped.pop("AttentionInterface", 2) == 2
    # and the continuous-batching entry point, which rides on the attention modules
    assert swapped.pop("ContinuousBatching", 2) == 2
    assert swapped == expected.kernelize_swapped
    assert report["kernelized_logits_max_abs"] <= TOLERANCE


def test_kernels_ran_their_pallas_implementation(report, expected):
    assert report["implementations"] == {op: ["pallas"] for op in expected.min_forward_calls}
    for op, calls in expected.min_forward_calls.items():
        assert report["op_calls"][op]["forward"] >= calls, op


def test_logits_match_the_stock_cpu_model(report):
    assert report["logits_max_abs"] <= TOLERANCE
    assert report["jit_logits_max_abs"] <= TOLERANCE


def test_training_step_gradients_match_the_stock_cpu_model(report, expected):
    assert report["params_with_grad"] == 21
    assert report["params_with_grad_by_kind"] == expected.params_by_kind
    assert report["params_with_zero_stock_grad"] == []  # no comparison is trivially 0 == 0
    assert report["loss_abs"] <= TOLERANCE and report["jit_loss_abs"] <= TOLERANCE
    assert report["grad_max_abs"] <= TOLERANCE
    assert report["jit_grad_max_abs"] <= TOLERANCE
    assert report["step_max_abs"] <= TOLERANCE


def test_jitted_training_step_holds_the_forward_and_backward_kernels(report, expected):
    assert report["kernels_in_training_step"] == sorted(expected.kernels_in_training_step)


def test_torch_autograd_runs_the_backward_ops_on_jax_tensors(report, expected):
    errors = report["op_autograd_max_abs"]
    assert set(errors) == set(expected.min_forward_calls)
    for op, by_output in errors.items():
        assert report["op_calls"][op]["backward"] >= 1, op
        assert max(by_output.values()) <= TOLERANCE, (op, by_output)


def test_sliced_inputs_arrive_as_torchax_views_and_work(report):
    assert report["view_input_type"] == "View"
    assert report["view_out_max_abs"] <= TOLERANCE


def test_no_host_copy_inside_kernel_ops(report):
    assert report["host_copies_inside_ops"] == 0
    assert report["inputs_not_passed_as_is"] == 0
    assert report["outputs_not_wrapped_as_is"] == 0
    assert report["kernel_functions_not_jitted"] == 0


def test_greedy_generation_gives_the_stock_models_tokens(report):
    assert len(report["generated_tokens"][0]) == 5 + 4
    assert report["generated_tokens"] == report["stock_generated_tokens"]
