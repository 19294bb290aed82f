"""torchax ("jax" device): a tiny Llama with kernel-hub's RMSNorm against the stock CPU model.

torchax renames torch's PrivateUse1 device and breaks torch.compile in any process that imports it,
so the checks run in a subprocess (torchax_checks.py) that prints a report; the thresholds are here.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TOLERANCE = 1e-4
SCRIPT = Path(__file__).with_name("torchax_checks.py")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["llama"])
def report(request) -> dict:
    if importlib.util.find_spec("torchax") is None:
        pytest.skip("torchax is not installed (scripts/test.sh installs the pinned dev build)")
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, str(SCRIPT), request.param],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert result.returncode == 0, f"torchax checks failed:\n{result.stderr[-6000:]}"
    return json.loads(result.stdout.splitlines()[-1])


def test_model_runs_on_the_jax_device_with_every_norm_swapped(report):
    assert report["swapped_layers"] == {"RMSNorm": 5}  # 2 layers x 2 norms + the final norm
    assert report["logits_type"] == "Tensor"  # torchax.tensor.Tensor, not a CPU tensor


def test_kernelize_swaps_the_norms_on_the_jax_device(report):
    swapped = report["kernelize_swapped"]
    assert report["kernelize_device"] == "jax"
    assert swapped["RMSNorm"] == 5
    # With the attention kernel loadable here (tokamax installed), its two modules swap too.
    assert swapped.get("AttentionInterface", 2) == 2 and set(swapped) <= {
        "RMSNorm",
        "AttentionInterface",
    }
    assert report["kernelized_logits_max_abs"] <= TOLERANCE


def test_kernels_ran_their_pallas_implementation(report):
    assert report["implementations"] == ["pallas"]
    assert report["op_calls"]["forward"] >= 5


def test_logits_match_the_stock_cpu_model(report):
    assert report["logits_max_abs"] <= TOLERANCE
    assert report["jit_logits_max_abs"] <= TOLERANCE


def test_training_step_gradients_match_the_stock_cpu_model(report):
    assert report["params_with_grad"] == 21 and report["norm_params_with_grad"] == 5
    assert report["loss_abs"] <= TOLERANCE and report["jit_loss_abs"] <= TOLERANCE
    assert report["grad_max_abs"] <= TOLERANCE
    assert report["jit_grad_max_abs"] <= TOLERANCE
    assert report["step_max_abs"] <= TOLERANCE


def test_jitted_training_step_holds_the_forward_and_backward_kernels(report):
    assert report["kernels_in_training_step"] == ["rms_norm_backward", "rms_norm_forward"]


def test_torch_autograd_runs_the_backward_op_on_jax_tensors(report):
    assert report["op_calls"]["backward"] >= 1
    assert report["op_out_max_abs"] <= TOLERANCE
    assert report["op_dx_max_abs"] <= TOLERANCE
    assert report["op_dweight_max_abs"] <= TOLERANCE


def test_sliced_inputs_arrive_as_torchax_views_and_work(report):
    assert report["view_input_type"] == "View"
    assert report["view_out_max_abs"] <= TOLERANCE


def test_no_host_copy_inside_kernel_ops(report):
    assert report["host_copies_inside_ops"] == 0
    assert report["inputs_not_passed_as_is"] == 0
    assert report["outputs_not_wrapped_as_is"] == 0


def test_greedy_generation_gives_the_stock_models_tokens(report):
    assert len(report["generated_tokens"][0]) == 5 + 4
    assert report["generated_tokens"] == report["stock_generated_tokens"]
