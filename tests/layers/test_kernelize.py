"""kernelize / unkernelize on a tiny Llama and small modules: what is swapped, what is left, why."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from kernel_hub import (
    KernelHubError,
    get_kernel,
    kernel_mapping,
    kernelize,
    unkernelize,
    use_kernel_forward,
)
from kernel_hub.errors import UnknownNameError
from kernel_hub.models.demo import demo_batch
from kernel_hub.models.tiny import build_tiny_model
from kernel_hub.paths import kernels_dir
from kernel_hub.testing import registry_with_ops

from .kernelize_helpers import TmpHub, swapped_modules, torch_rmsnorm_kernel

NORMS = [
    "model.layers.0.input_layernorm",
    "model.layers.0.post_attention_layernorm",
    "model.layers.1.input_layernorm",
    "model.layers.1.post_attention_layernorm",
    "model.norm",
]


@pytest.fixture(autouse=True)
def _rmsnorm_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests count what the rmsnorm kernel swaps; other registry ops would add to it."""
    monkeypatch.setenv("KERNEL_HUB_REGISTRY", str(registry_with_ops(tmp_path, "rmsnorm")))


@use_kernel_forward("RMSNorm")
class UserNorm(torch.nn.Module):
    """A user's norm marked with kernel-hub's decorator; weight shape is chosen by the test."""

    def __init__(self, *shape: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(*shape) + 0.5)
        self.variance_epsilon = 1e-6

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * hidden_states * torch.rsqrt(variance + self.variance_epsilon)


@use_kernel_forward("NoSuchLayer")
class UnknownLayer(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def rmsnorm_hub(hub: TmpHub, **flags: object) -> Path:
    hub.add_kernel("rmsnorm", torch_rmsnorm_kernel(**flags), layers=("RMSNorm",))
    return hub.write_registry({"rmsnorm": {"layers": ["RMSNorm"]}})


def by_module(report) -> dict:
    return {e.module: e for e in report.entries}


def test_report_names_every_candidate_and_only_forward_changes() -> None:
    model = build_tiny_model("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = kernelize(model)
    entries = by_module(report)
    kernel = get_kernel("rmsnorm")
    for name in NORMS:
        entry = entries[name]
        assert (entry.cls, entry.found_by, entry.op) == ("LlamaRMSNorm", "recognised", "rmsnorm")
        assert entry.swapped_to == f"rmsnorm {kernel.manifest.version} layers.RMSNorm"
        module = model.get_submodule(name)
        assert module.forward.__func__ is kernel.layers.RMSNorm.forward
        assert module.forward.__self__ is module and type(module) is LlamaRMSNorm
    attention = [e for e in report.entries if e.kind == "attention"]
    assert [e.module for e in attention] == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert sorted(swapped_modules(model)) == sorted(e.module for e in report.swapped)
    assert report.mode == "inference" and report.device == "cpu"
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert "5 swapped" in report.summary() and "model.norm" in str(report)


def test_model_without_candidates_is_untouched() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    x = torch.randn(2, 4)
    expected = model(x)
    report = kernelize(model, mode="training")
    assert report.entries == ()
    assert "no replaceable layers found; the model is unchanged" in str(report)
    assert swapped_modules(model) == []
    assert torch.equal(model(x), expected)


def test_decorated_user_module_is_swapped_and_matches() -> None:
    model = torch.nn.Sequential(UserNorm(16), torch.nn.Linear(16, 4))
    x = torch.randn(3, 16)
    expected = model(x)
    report = kernelize(model)
    (entry,) = report.entries
    assert (entry.module, entry.found_by, entry.swapped) == ("0", "kernel_layer_name", True)
    torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)
    assert unkernelize(model) == ["0"]
    assert torch.equal(model(x), expected)


def test_unknown_layer_name_is_reported() -> None:
    report = kernelize(torch.nn.Sequential(UnknownLayer()))
    (entry,) = report.entries
    assert not entry.swapped and entry.op is None
    assert "no op in registry.yaml provides layer 'NoSuchLayer'" in entry.reason
    # the rmsnorm-only registry
    assert (
        "layers provided: DiffusersRMSNorm, RMSNorm, RMSNormF32Scale, RMSNormGated, "
        "RMSNormGatedGrouped, RMSNormOfX, RMSNormOptionalScale, RMSNormZeroCentered, "
        "TorchRMSNorm" in entry.reason
    )


def test_unsupported_module_state_is_reported() -> None:
    report = kernelize(torch.nn.Sequential(UserNorm(4, 16)))
    (entry,) = report.entries
    assert not entry.swapped
    assert "weight has shape (4, 16); a 1-D weight is needed" in entry.reason


def test_mapping_off_leaves_layers_alone() -> None:
    model = build_tiny_model("llama")
    with kernel_mapping({"rmsnorm": "off"}):
        report = kernelize(model)
    assert not report.swapped and swapped_modules(model) == []
    assert {e.reason for e in report.entries if e.kind == "layer"} == {
        "kernel_mapping sets 'rmsnorm' off"
    }


def test_mapping_directory() -> None:
    model = build_tiny_model("llama")
    with kernel_mapping({"rmsnorm": kernels_dir() / "rmsnorm"}):
        report = kernelize(model)
    assert len(report.swapped) == len(NORMS)
    assert model.model.norm.forward.__func__.__module__.endswith(".layers")


def test_mapping_version_asks_the_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A version selects a hub build (tests/hub covers loading one); the built-in registry pins no
    signing key for kernel-hub's builds yet, so the build is refused before any request and every
    module keeps its forward, with the hub's reason."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.chdir(tmp_path)  # no kernel-hub.lock
    model = build_tiny_model("llama")
    with kernel_mapping({"RMSNorm": "1.0.0"}):
        report = kernelize(model)
    assert not report.swapped and swapped_modules(model) == []
    assert "pins no signing key for kernel-hub/rmsnorm" in report.entries[0].reason


def test_unknown_mapping_key_fails_kernelize() -> None:
    with kernel_mapping({"RMSNrom": "off"}), pytest.raises(UnknownNameError, match="RMSNorm"):
        kernelize(build_tiny_model("llama"))


def test_signature_mismatch_is_reported(tmp_hub: TmpHub) -> None:
    registry = rmsnorm_hub(tmp_hub, arg="x")
    model = build_tiny_model("llama")
    report = kernelize(model, registry=registry)
    reasons = {e.reason for e in report.entries if e.kind == "layer"}
    assert reasons == {
        "forward signatures differ: LlamaRMSNorm.forward(self, hidden_states) vs "
        "layers.RMSNorm.forward(self, x)"
    }
    assert swapped_modules(model) == []


def test_training_mode_needs_a_backward(tmp_hub: TmpHub) -> None:
    registry = rmsnorm_hub(tmp_hub, has_backward=False)
    model = build_tiny_model("llama")
    report = kernelize(model, mode="training", registry=registry)
    assert not report.swapped
    assert "has no backward (has_backward = False), needed in training mode" in (
        report.entries[0].reason
    )
    assert len(kernelize(model, mode="inference", registry=registry).swapped) == len(NORMS)


def test_torch_compile_mode_needs_the_flag(tmp_hub: TmpHub) -> None:
    registry = rmsnorm_hub(tmp_hub, can_torch_compile=False)
    report = kernelize(build_tiny_model("llama"), mode="inference+torch_compile", registry=registry)
    assert not report.swapped
    assert "does not declare can_torch_compile = True" in report.entries[0].reason


def test_device_without_kernels() -> None:
    model = build_tiny_model("llama")
    report = kernelize(model, device="mps")
    assert not report.swapped and swapped_modules(model) == []
    assert "no kernels for device type 'mps'" in report.entries[0].reason


def test_op_without_an_implementation_for_this_platform(tmp_hub: TmpHub) -> None:
    tmp_hub.add_kernel("rmsnorm", torch_rmsnorm_kernel(), layers=("RMSNorm",))
    registry = tmp_hub.write_registry(
        {"rmsnorm": {"layers": ["RMSNorm"], "implementations": {"tpu": ["torch"]}}}
    )
    report = kernelize(build_tiny_model("llama"), registry=registry)
    assert not report.swapped
    assert "op 'rmsnorm' has no kernel for cpu (it runs on: tpu)" in report.entries[0].reason


def test_op_without_a_registry_order_runs_in_the_kernels_order(tmp_hub: TmpHub) -> None:
    """``implementations`` is an optional override: without it the kernel's own order applies."""
    tmp_hub.add_kernel("rmsnorm", torch_rmsnorm_kernel(), layers=("RMSNorm",))
    registry = tmp_hub.write_registry({"rmsnorm": {"layers": ["RMSNorm"]}})
    text = registry.read_text()
    registry.write_text(text.replace("    implementations:\n      cpu:\n      - torch\n", ""))
    assert "implementations" not in registry.read_text()
    report = kernelize(build_tiny_model("llama"), registry=registry)
    assert report.swapped, [entry.reason for entry in report.entries]


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"mode": "inferance"}, UnknownNameError, "Did you mean 'inference'"),
        ({"device": "nonsense"}, KernelHubError, "invalid device 'nonsense'"),
    ],
)
def test_bad_arguments(kwargs: dict, error: type, message: str) -> None:
    model = build_tiny_model("llama")
    with pytest.raises(error, match=message):
        kernelize(model, **kwargs)
    assert swapped_modules(model) == []


def test_not_a_module() -> None:
    with pytest.raises(KernelHubError, match=r"takes a torch\.nn\.Module"):
        kernelize("model")


def test_instance_forward_set_by_someone_else_is_kept() -> None:
    model = build_tiny_model("llama")
    hooked = model.model.norm

    def traced(self, hidden_states):  # a hook's wrapper: not the class's own forward
        return LlamaRMSNorm.forward(self, hidden_states)

    hooked.forward = types.MethodType(traced, hooked)
    report = kernelize(model)
    assert "already replaced on the instance" in by_module(report)["model.norm"].reason
    assert len(report.swapped) == len(NORMS) - 1
    unkernelize(model)
    assert swapped_modules(model) == ["model.norm"]


def test_kernelize_again_starts_from_stock_and_unkernelize_restores() -> None:
    model = build_tiny_model("llama")
    batch = demo_batch()
    with torch.no_grad():
        stock = model(**batch).logits
    kernelize(model)
    report = kernelize(model)
    assert len(report.swapped) == len(NORMS)
    assert sorted(unkernelize(model)) == sorted(NORMS)
    assert swapped_modules(model) == [] and unkernelize(model) == []
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, stock)
