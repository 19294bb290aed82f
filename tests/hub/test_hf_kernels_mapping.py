"""Hugging Face ``kernels`` loads kernel-hub builds from a local ``kernel-hub serve`` through
``hub_layer_mapping``, and a tiny Llama it kernelizes matches stock."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kernel_hub.errors import KernelHubError
from kernel_hub.layers.integrations.hf_kernels import DEVICES, FUNCTION_SLOTS, hub_layer_mapping
from kernel_hub.models.tiny import build_tiny_model
from kernel_hub.registry.registry import load_registry

from .hub_helpers import cache_dir

kernels = pytest.importorskip("kernels")


def test_mapping_has_tpu_and_cpu_entries_for_every_served_layer() -> None:
    mapping = hub_layer_mapping()
    registry = load_registry()
    layers = {layer: (entry, layer) for entry in registry if entry.repo for layer in entry.layers}
    layers.update({slot: (registry.get(op), layer) for slot, (op, layer) in FUNCTION_SLOTS.items()})
    assert set(mapping) == set(layers)
    assert {"RMSNorm", "LayerNorm", "MoEExperts", "rotary_pos_emb"} <= set(mapping)
    for slot, by_device in mapping.items():
        assert tuple(by_device) == DEVICES
        for repository in by_device.values():
            entry, layer = layers[slot]
            assert repository.layer_name == layer
            assert repository._repo_id == entry.repo  # kernels keeps no public getter
            assert repository._version == 1  # the registry's ">=1.0,<2": branch v1
    with pytest.raises(KernelHubError, match="kernel-hub builds serve tpu, cpu"):
        hub_layer_mapping(devices=("cuda",))


@pytest.fixture
def extensible_llama_norm():
    """Transformers 5.24's RMSNorm decorators need kernels >= 0.18.2 and are inert with 0.17:
    mark Llama's RMSNorm for ``kernels`` as the decorator would, and undo it after."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    before = dict(vars(LlamaRMSNorm))
    kernels.replace_kernel_forward_from_hub(LlamaRMSNorm, "RMSNorm")
    yield
    for name in set(vars(LlamaRMSNorm)) - set(before):
        delattr(LlamaRMSNorm, name)
    for name, value in before.items():
        if vars(LlamaRMSNorm).get(name) is not value:
            setattr(LlamaRMSNorm, name, value)


def test_kernels_kernelize_loads_kernel_hub_builds_from_a_local_serve(
    publish, hub_env, extensible_llama_norm, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from huggingface_hub import constants

    # kernels 0.17.2 with telemetry off sends a User-Agent ending in "; ", which huggingface_hub
    # 2.4's HTTP client refuses ("Illegal header value"); hub_env turned it off, so turn it on:
    # every request still goes to the local server (hub_env points constants.ENDPOINT there)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", False)
    # kernels downloads into KERNELS_CACHE as read at its import, else huggingface_hub's default
    # cache (~/.cache): point it at this test's cache instead
    monkeypatch.setattr(kernels.resolver, "CACHE_DIR", str(cache_dir(tmp_path)))
    published = publish("1.0.0")  # signed rmsnorm build, tag v1.0.0, branch v1, on 127.0.0.1
    model = build_tiny_model("llama")
    ids = torch.randint(2, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        stock = model(input_ids=ids).logits
    # kernels asks the Hub whether kernel-hub is a trusted kernel publisher; the local store
    # cannot say, so the repo is trusted explicitly (kernel-hub's signature goes unchecked here)
    mapping = {"RMSNorm": hub_layer_mapping(trust_remote_code=[published.repo])["RMSNorm"]}
    with kernels.use_kernel_mapping(mapping, inherit_mapping=False):
        kernels.kernelize(model, mode=kernels.Mode.INFERENCE, device="cpu", use_fallback=False)
    norms = [m for m in model.modules() if type(m).__name__ == "LlamaRMSNorm"]
    assert len(norms) == 5
    for norm in norms:  # each forward is now the kernel-hub build's layer, from the hub cache
        assert norm.forward.__func__.__module__.endswith(".layers"), norm.forward
    with torch.no_grad():
        kernelized = model(input_ids=ids).logits
    torch.testing.assert_close(kernelized, stock, rtol=1e-5, atol=1e-5)
    fetched = [path for method, path in hub_env.requests if method == "GET"]
    assert any(published.commit in path or "rmsnorm" in path for path in fetched), fetched


@pytest.fixture
def extensible_llama_rotary(monkeypatch: pytest.MonkeyPatch):
    """Transformers 5.24's function-slot decorators are inert with kernels 0.17 as well: make
    Llama's ``apply_rotary_pos_emb`` the ``kernels`` function module its decorator would make
    (a global, called by every attention layer); ``attach(model)`` then does what
    ``use_kernelized_func`` does at each LlamaAttention's construction."""
    from transformers.models.llama import modeling_llama

    func = kernels.use_kernel_forward_from_hub("rotary_pos_emb")(
        modeling_llama.apply_rotary_pos_emb
    )
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", func)

    def attach(model: torch.nn.Module) -> list[torch.nn.Module]:
        attentions = [m for m in model.modules() if isinstance(m, modeling_llama.LlamaAttention)]
        for attention in attentions:
            attention.__dict__.setdefault("_kernel_funcs", {})["apply_rotary_pos_emb"] = func
        return attentions

    return func, attach


def test_kernels_fills_the_rotary_function_slot_from_a_local_serve(
    hub_env, keys, extensible_llama_rotary, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from huggingface_hub import constants

    from kernel_hub.hub.publish import publish_kernel
    from kernel_hub.paths import BUILTIN_DIR, kernels_dir

    monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", False)  # see the test above
    monkeypatch.setattr(kernels.resolver, "CACHE_DIR", str(cache_dir(tmp_path)))
    published = publish_kernel(
        kernels_dir() / "rotary",
        "kernel-hub/rotary",
        sign_key=keys["publisher"].private_path,
        build_dir=tmp_path / "build",
    )
    func, attach = extensible_llama_rotary
    model = build_tiny_model("llama")
    assert len(attach(model)) == 2
    ids = torch.randint(2, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    weights = torch.randn(2, 12, 128, generator=torch.Generator().manual_seed(1))

    def logits_and_grads():
        model.zero_grad()
        logits = model(input_ids=ids).logits
        (logits * weights).sum().backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    stock, stock_grads = logits_and_grads()
    builtin = BUILTIN_DIR / "registry.yaml"  # hub_env's test registry lists rmsnorm alone
    mapping = hub_layer_mapping(builtin, trust_remote_code=[published.repo])
    mapping = {"rotary_pos_emb": mapping["rotary_pos_emb"]}
    with kernels.use_kernel_mapping(mapping, inherit_mapping=False):
        kernels.kernelize(model, mode=kernels.Mode.TRAINING, device="cpu", use_fallback=False)
    # the slot's forward is now the rotary build's layer, loaded from the hub cache
    assert func.forward.__func__.__qualname__ == "ApplyRotaryPosEmb.forward"
    assert not func.forward.__func__.__module__.startswith("kernel_hub"), func.forward
    calls = []
    monkeypatch.setattr(func, "forward", _recording(func.forward, calls))
    kernelized, grads = logits_and_grads()
    assert len(calls) == 2  # once per attention layer
    torch.testing.assert_close(kernelized, stock, rtol=1e-5, atol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, stock_grads[name], rtol=1e-5, atol=1e-5, msg=name)
    fetched = [path for method, path in hub_env.requests if method == "GET"]
    assert any("rotary" in path for path in fetched), fetched


def _recording(forward, calls: list):
    def recording(*args, **kwargs):
        calls.append(1)
        return forward(*args, **kwargs)

    return recording
