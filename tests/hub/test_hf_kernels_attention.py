"""Transformers' hub attention (``attn_implementation="kernel-hub/attention"``) loads kernel-hub's
attention build from a local ``kernel-hub serve`` through Hugging Face ``kernels`` and drives its
flash-attn entry points; a tiny Llama, Mistral (sliding window) and Gemma 2 (soft-cap) give
SDPA's logits and gradients (eager's for Gemma 2, which has no SDPA path) on a left-padded
batch."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from kernel_hub.models.tiny import build_tiny_model, tiny_model
from kernel_hub.paths import kernels_dir

from .hub_helpers import cache_dir

kernels = pytest.importorskip("kernels")

REPO = "kernel-hub/attention"
ATTN = f"{REPO}:flash_attn_varlen_func"


@pytest.fixture
def attention_served(hub_env, keys, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    """The in-tree attention kernel published (signed) to the local hub; ``kernels`` set to
    fetch from it into this test's cache (see test_hf_kernels_pinned.py for why each patch)."""
    from huggingface_hub import constants
    from transformers import modeling_flash_attention_utils as flash_utils
    from transformers.integrations import hub_kernels

    from kernel_hub.hub.publish import publish_kernel

    # Transformers 5.24 gates hub kernels on kernels >= 0.18.2 (not on PyPI as of this writing;
    # 0.17.2 is installed) and then skips importing kernels' get_kernel: open the gate and give
    # it the installed get_kernel, whose signature is the one it calls; the rest runs as shipped
    monkeypatch.setattr(hub_kernels, "is_kernels_available", lambda: True)
    monkeypatch.setattr(hub_kernels, "get_kernel_hub", kernels.get_kernel, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", False)
    # Transformers keeps the last loaded flash implementation process-wide: load this one afresh
    monkeypatch.setattr(flash_utils, "_loaded_implementation", None)
    monkeypatch.setattr(kernels.resolver, "CACHE_DIR", str(cache_dir(tmp_path)))
    publish_kernel(
        kernels_dir() / "attention",
        REPO,
        sign_key=keys["publisher"].private_path,
        build_dir=tmp_path / "build",
    )
    return ATTN


def _gemma2() -> torch.nn.Module:
    from transformers import Gemma2ForCausalLM

    return tiny_model(
        Gemma2ForCausalLM,
        head_dim=16,
        sliding_window=4,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=None,
        query_pre_attn_scalar=12,
        pad_token_id=0,
    )


MODELS = {
    "llama": lambda: build_tiny_model("llama"),
    "mistral-window": lambda: build_tiny_model("mistral"),
    "gemma2-softcap-window": _gemma2,
}
OPTIONS = {  # per layer: the window_size and softcap Transformers sends (window 4: (3, 3))
    "llama": [(None, None)] * 2,
    "mistral-window": [((3, 3), None)] * 2,
    "gemma2-softcap-window": [((3, 3), 5.0), (None, 5.0)],  # sliding, then full
}


def _record_flash_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """(function, window_size, softcap) of each call Transformers makes to the loaded build's
    flash-attn functions; each must be this kernel's (from the hub cache, not the in-tree
    package)."""
    from transformers import modeling_flash_attention_utils as flash_utils

    calls: list[tuple] = []
    for slot in ("_flash_fn", "_flash_varlen_fn"):
        function = getattr(flash_utils, slot)
        assert function.__module__.endswith("flash_attention.flash_attn_api"), function.__module__
        assert not function.__module__.startswith("kernel_hub"), function.__module__

        def recording(*args, _function=function, **kwargs):
            calls.append((_function.__name__, kwargs.get("window_size"), kwargs.get("softcap")))
            return _function(*args, **kwargs)

        monkeypatch.setattr(flash_utils, slot, recording)
    return calls


def _left_padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(2, 128, (3, 10), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    mask[2, :1] = 0
    return ids.masked_fill(mask == 0, 0), mask


def _logits_and_grads(model, ids, mask, weights):
    model.zero_grad()
    logits = model(input_ids=ids, attention_mask=mask).logits
    valid = mask.bool()
    (logits[valid] * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits[valid].detach(), grads


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
def test_hub_attention_matches_sdpa_on_left_padded_batch(
    name, attention_served, hub_env, monkeypatch: pytest.MonkeyPatch
) -> None:
    stock = MODELS[name]()
    stock.set_attn_implementation("sdpa" if stock._supports_sdpa else "eager")  # Gemma 2: eager
    hub = copy.deepcopy(stock)
    hub.set_attn_implementation(attention_served, allow_all_kernels=True)
    assert hub.config._attn_implementation == attention_served
    calls = _record_flash_calls(monkeypatch)

    ids, mask = _left_padded_batch()
    weights = torch.randn(int(mask.sum()), stock.config.vocab_size)
    expected, expected_grads = _logits_and_grads(stock, ids, mask, weights)
    got, grads = _logits_and_grads(hub, ids, mask, weights)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    expected_calls = [("flash_attn_varlen_func", *options) for options in OPTIONS[name]]
    assert calls == expected_calls, calls  # padded: the varlen entry point, once per layer
    assert grads.keys() == expected_grads.keys()
    for param, grad in grads.items():  # 1e-5 of each gradient's scale (Gemma 2's embedding
        reference = expected_grads[param]  # gradient reaches ~100: f32 sums differ by ~2e-5)
        scale = max(1.0, reference.abs().max().item())
        torch.testing.assert_close(
            grad, reference, rtol=1e-5, atol=1e-5 * scale, msg=lambda m, p=param: f"{p}: {m}"
        )

    calls.clear()  # an unpadded batch takes flash_attn_func
    with torch.no_grad():
        full = torch.ones_like(mask)
        torch.testing.assert_close(
            hub(input_ids=ids, attention_mask=full).logits,
            stock(input_ids=ids, attention_mask=full).logits,
            rtol=1e-5,
            atol=1e-5,
        )
    assert calls == [("flash_attn_func", *options) for options in OPTIONS[name]], calls

    # greedy decoding from the left-padded batch: one query per sequence against its cache
    # (varlen with fewer queries than keys, each aligned to the end of its keys)
    calls.clear()
    generated = [
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=3,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
        for model in (stock, hub)
    ]
    assert torch.equal(generated[0].sequences, generated[1].sequences)
    for expected_step, step in zip(generated[0].logits, generated[1].logits, strict=True):
        torch.testing.assert_close(step, expected_step, rtol=1e-5, atol=1e-5)
    assert len(calls) == 3 * len(OPTIONS[name]), calls
    fetched = [path for method, path in hub_env.requests if method == "GET"]
    assert any("attention" in path for path in fetched), fetched
