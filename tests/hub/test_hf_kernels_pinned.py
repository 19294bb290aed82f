"""The Hugging Face ``kernels`` path with exactly the pinned versions (constraints.txt:
transformers 5.24.0, kernels 0.17.2), end to end against a local ``kernel-hub serve``.

Signed rmsnorm, rotary, moe-gemm and attention builds are published to 127.0.0.1; a tiny Llama
and a tiny Mixtral are kernelized through ``kernels`` itself: layers (RMSNorm, MoE experts) and
the rotary function slot by ``kernels.kernelize`` with ``hub_layer_mapping()``, attention by
``kernel_hub``'s ``hub_attention`` (``kernels.get_kernel`` + the build's AttentionInterface
function). Each kernel op call is counted (forward and backward), and logits and every gradient
equal stock's within f32 tolerance.

What this pair cannot do as shipped, and why (asserted below, so the test says when it changes):
Transformers 5.24 accepts only ``kernels>=0.18.2,<0.19``, so its ``use_kernel_forward_from_hub``
/ ``use_kernelized_func`` decorators are inert stubs (the classes and functions are marked here
with ``kernels``' own ``replace_kernel_forward_from_hub`` / ``use_kernel_forward_from_hub``, which
is what those decorators do with a compatible ``kernels``), ``set_use_kernels`` raises
``ValueError: Kernels are not available`` and ``attn_implementation="org/repo"`` raises
``ImportError`` from ``load_and_register_attn_kernel``.
"""

from __future__ import annotations

import copy
import re
import types
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kernel_hub.errors import KernelHubError
from kernel_hub.layers.integrations.hf_kernels import hub_attention, hub_layer_mapping
from kernel_hub.models.tiny import build_tiny_model
from kernel_hub.paths import BUILTIN_DIR, kernels_dir

from .hub_helpers import cache_dir

kernels = pytest.importorskip("kernels")

BUILDS = {  # kernel directory -> hub repo (the built-in registry's repos)
    "rmsnorm": "kernel-hub/rmsnorm",
    "rotary": "kernel-hub/rotary",
    "moe-gemm": "kernel-hub/moe-gemm",
    "attention": "kernel-hub/attention",
}


@pytest.fixture(autouse=True)
def _pinned_pair() -> None:
    from transformers.utils import import_utils

    if import_utils.is_kernels_available():
        pytest.fail(
            "this transformers accepts this kernels: use its own decorators and use_kernels=True "
            "here instead of marking classes by hand"
        )


@pytest.fixture
def served(hub_env, keys, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, str]:
    """The four builds published (signed) to the local hub, ``kernels`` pointed at it."""
    from huggingface_hub import constants

    from kernel_hub.hub.publish import publish_kernel

    # kernels 0.17.2 with telemetry off sends a User-Agent ending in "; ", which huggingface_hub
    # 2.4 refuses; requests still go to the local server (hub_env points constants there)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", False)
    monkeypatch.setattr(kernels.resolver, "CACHE_DIR", str(cache_dir(tmp_path)))
    for kernel, repo in BUILDS.items():
        publish_kernel(
            kernels_dir() / kernel,
            repo,
            sign_key=keys["publisher"].private_path,
            build_dir=tmp_path / "build" / kernel,
        )
    return BUILDS


@pytest.fixture
def marked(monkeypatch: pytest.MonkeyPatch):
    """Mark what Transformers 5.24's decorators would mark with a compatible ``kernels``: the
    RMSNorm and experts classes, and each model's ``apply_rotary_pos_emb`` as a ``kernels``
    function module; ``attach(model)`` does what ``use_kernelized_func`` does at each attention
    layer's construction. Undone after the test."""
    from transformers.models.llama import modeling_llama
    from transformers.models.mixtral import modeling_mixtral

    for cls, name in (
        (modeling_llama.LlamaRMSNorm, "RMSNorm"),
        (modeling_mixtral.MixtralRMSNorm, "RMSNorm"),
        (modeling_mixtral.MixtralExperts, "MoEExperts"),
    ):
        for attribute in ("kernel_layer_name", "kernel_condition"):  # undo: delete them again
            monkeypatch.setattr(cls, attribute, None, raising=False)
        kernels.replace_kernel_forward_from_hub(cls, name)
    slots = {}
    for module in (modeling_llama, modeling_mixtral):
        func = kernels.use_kernel_forward_from_hub("rotary_pos_emb")(module.apply_rotary_pos_emb)
        monkeypatch.setattr(module, "apply_rotary_pos_emb", func)
        slots[module] = func

    def attach(model: torch.nn.Module) -> None:
        for layer in model.modules():
            if type(layer).__name__.endswith("Attention"):
                func = slots[__import__(type(layer).__module__, fromlist=["_"])]
                layer.__dict__.setdefault("_kernel_funcs", {})["apply_rotary_pos_emb"] = func

    return attach


@pytest.fixture
def clean_attention_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """``hub_attention`` registers in Transformers' process-wide interfaces: restore them."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    for interface in (AttentionInterface, AttentionMaskInterface):
        mapping = interface._global_mapping
        monkeypatch.setattr(interface, "_global_mapping", dict(mapping))


class OpCounter(TorchDispatchMode):
    """Counts custom (non-aten) torch op calls by ``namespace::name``: each kernel call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace not in ("aten", "prim", "prims"):
            self.calls[f"{func.namespace}::{func._opname}"] += 1
        return func(*args, **(kwargs or {}))


def _run(model, ids, weights):
    model.zero_grad()
    with OpCounter() as counter:
        logits = model(input_ids=ids).logits
        (logits * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads, counter.calls


def _by_op(calls: Counter[str]) -> dict[str, int]:
    """Calls per op name, the loaded build's namespace dropped (unique per loaded module)."""
    totals: Counter[str] = Counter()
    for name, count in calls.items():
        totals[name.split("::")[1]] += count
    return dict(totals)


EXPECTED = {  # per op, forward + backward, for 2 decoder layers
    "llama": {
        "rms_norm": 5,  # 2 per layer + the final norm
        "rms_norm_backward": 5,
        "rotary_embedding": 2,
        "rotary_embedding_backward": 2,
        "attention_with_lse": 2,
        "attention_with_lse_backward": 2,
    },
}
EXPECTED["mixtral"] = {**EXPECTED["llama"], "gmm": 4, "gmm_backward": 4}  # gate_up, down a layer


def test_tiny_models_kernelized_through_kernels_match_stock(
    served,
    marked,
    clean_attention_registry,
    hub_env,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    builtin = BUILTIN_DIR / "registry.yaml"  # hub_env's test registry lists rmsnorm alone
    with pytest.warns(UserWarning, match=r"kernels>=0\.18\.2,<0\.19\.0; with kernels 0\.17\.2"):
        mapping = hub_layer_mapping(builtin, trust_remote_code=list(served.values()))
    attention = hub_attention(served["attention"], trust_remote_code=True)
    assert attention == "kernel-hub--attention"
    with pytest.raises(KernelHubError, match="expected an 'org/name' hub repo id"):
        hub_attention("attention")
    with monkeypatch.context() as patch:  # a build that is not kernel-hub's
        patch.setattr(kernels, "get_kernel", lambda *args, **kwargs: types.ModuleType("other"))
        with pytest.raises(KernelHubError, match="org/other v1 declares no KERNEL: it is not a"):
            hub_attention("org/other")
    for name in ("llama", "mixtral"):
        _check_kernelized_model(name, mapping, attention, served, marked)
    assert "invalid build variant" not in caplog.text  # kernels parses every variant name
    fetched = {path for method, path in hub_env.requests if method == "GET"}
    for repo in served.values():
        assert any(repo.split("/")[1] in path for path in fetched), (repo, fetched)


def _check_kernelized_model(name: str, mapping, attention: str, served, attach) -> None:
    stock = build_tiny_model(name)
    stock.set_attn_implementation("sdpa")
    model = copy.deepcopy(stock)
    ids = torch.randint(2, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    weights = torch.randn(2, 12, 128, generator=torch.Generator().manual_seed(1))
    expected, expected_grads, stock_calls = _run(stock, ids, weights)
    assert not stock_calls

    # what the pinned Transformers refuses, as shipped
    with pytest.raises(ValueError, match=r"Kernels are not available.*0\.18\.2"):
        copy.deepcopy(stock).set_use_kernels(True)
    with pytest.raises(ImportError, match=r"0\.18\.2 <= version < 0\.19\.0"):
        copy.deepcopy(stock).set_attn_implementation(served["attention"])

    attach(model)
    with kernels.use_kernel_mapping(mapping, inherit_mapping=False):
        kernels.kernelize(model, mode=kernels.Mode.TRAINING, device="cpu", use_fallback=False)
    model.set_attn_implementation(attention)

    got, grads, calls = _run(model, ids, weights)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert grads.keys() == expected_grads.keys()
    for param, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[param], rtol=1e-5, atol=1e-5, msg=param)
    assert _by_op(calls) == EXPECTED[name], (name, calls)
    # every op is one of the builds kernels loaded (its module: name_version_variant_hash)
    namespaces = {call.split("::")[0] for call in calls}
    assert all(re.search(r"_\d+_\d+_\d+_torch_cpu_[0-9a-f]{8}$", ns) for ns in namespaces), calls
