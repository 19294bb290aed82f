"""Diffusers: tiny Flux/Wan transformers kernelized (attention through the dispatcher, LayerNorms),
exact restore, no global state; SD3/UNet processors reported; the backend's argument contract."""

from __future__ import annotations

import copy

import pytest
import torch
from diffusers import (
    FluxTransformer2DModel,
    SD3Transformer2DModel,
    UNet2DConditionModel,
    WanTransformer3DModel,
)
from diffusers.models.attention_dispatch import (
    _AttentionBackendRegistry,
    dispatch_attention_fn,
)

from kernel_hub import get_kernel, kernelize, unkernelize
from kernel_hub.errors import KernelInputError
from kernel_hub.testing import max_errors

from .kernelize_helpers import TOLERANCE


def tiny_flux():
    torch.manual_seed(0)
    model = FluxTransformer2DModel(
        patch_size=1,
        in_channels=4,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=(4, 6, 6),
    )
    batch, image, text = 2, 16, 8
    inputs = {
        "hidden_states": torch.randn(batch, image, 4),
        "encoder_hidden_states": torch.randn(batch, text, 32),
        "pooled_projections": torch.randn(batch, 32),
        "timestep": torch.tensor([0.5, 0.7]),
        "img_ids": torch.randn(image, 3),
        "txt_ids": torch.zeros(text, 3),
    }
    return model, inputs


def tiny_wan():
    torch.manual_seed(0)
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=4,
        out_channels=4,
        text_dim=16,
        freq_dim=32,
        ffn_dim=32,
        num_layers=2,
        rope_max_seq_len=32,
    )
    inputs = {
        "hidden_states": torch.randn(2, 4, 2, 4, 4),
        "timestep": torch.tensor([3, 7]),
        "encoder_hidden_states": torch.randn(2, 6, 16),
    }
    return model, inputs


MODELS = {"flux": tiny_flux, "wan": tiny_wan}


def run(model, inputs):
    """Output and every parameter's gradient of a sum-of-squares loss."""
    model.zero_grad()
    out = model(**inputs, return_dict=False)[0]
    out.square().mean().backward()
    return out.detach(), {
        n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
    }


@pytest.fixture
def attention_calls(monkeypatch):
    """Counts the attention kernel's torch op calls made by the Diffusers backend."""
    ops = get_kernel("attention").torch_api
    calls = []
    for name in ("attention_with_lse", "attention_forward_only", "attention_with_dense_mask"):
        op = getattr(ops, name)
        monkeypatch.setattr(
            ops, name, lambda *a, _op=op, _n=name, **kw: calls.append(_n) or _op(*a, **kw)
        )
    return calls


@pytest.mark.parametrize("name", sorted(MODELS))
def test_kernelized_transformer_matches_stock_and_restores_exactly(name, attention_calls):
    model, inputs = MODELS[name]()
    model.train()
    active_before = _AttentionBackendRegistry.get_active_backend()
    stock_out, stock_grads = run(model, inputs)

    report = kernelize(model, mode="training")
    attention = [e for e in report.entries if e.kind == "attention"]
    norms = [e for e in report.entries if e.kind == "layer" and "Norm" in e.target]
    assert attention and all(e.swapped_to for e in attention), report
    # all but the per-head q/k norms before a rotary (see the next test)
    assert norms and all(e.swapped_to or "per-head q/k norm" in e.reason for e in norms), report
    assert any(e.swapped_to for e in norms), report
    out, grads = run(model, inputs)
    assert attention_calls, "kernel-hub attention never ran"
    assert _AttentionBackendRegistry.get_active_backend() == active_before

    abs_err, _ = max_errors(out, stock_out)
    assert abs_err <= TOLERANCE, f"output max abs {abs_err:.3g}"
    assert grads.keys() == stock_grads.keys()
    for param, grad in grads.items():
        scale = max(1.0, float(stock_grads[param].abs().max()))
        abs_err, _ = max_errors(grad, stock_grads[param])
        assert abs_err <= TOLERANCE * scale, f"{param}: grad max abs {abs_err:.3g}"

    unkernelize(model)
    assert all(
        "_attention_backend" not in m.processor.__dict__
        for m in model.modules()
        if hasattr(m, "processor")
    )
    restored_out, restored_grads = run(model, inputs)
    assert torch.equal(restored_out, stock_out)
    assert all(torch.equal(restored_grads[n], g) for n, g in stock_grads.items())


@pytest.mark.parametrize(
    ("name", "swapped", "left_to_xla"),
    [
        # Flux's norm_q, norm_k, norm_added_q, norm_added_k: over the head dim, then rotated
        ("flux", {"LayerNorm"}, {"norm_q", "norm_k", "norm_added_q", "norm_added_k"}),
        # Wan's q/k norms are over all heads
        ("wan", {"FP32LayerNorm", "TorchRMSNorm"}, set()),
    ],
)
def test_norms_are_swapped_but_per_head_qk_norms_before_a_rotary(name, swapped, left_to_xla):
    """Every norm gets its kernel except a per-head q/k norm whose processor then applies
    ``apply_rotary_emb``: XLA fuses that norm into the rotary, and after a kernel call it
    relayouts the norm's output instead (docs/model-bench.md), so kernelize leaves it to XLA
    and says why."""
    model, _ = MODELS[name]()
    report = kernelize(model, mode="inference")
    norms = [e for e in report.entries if e.kind == "layer"]
    kept = [e for e in norms if not e.swapped]
    assert {e.target for e in norms if e.swapped} == swapped, report
    assert {e.module.rsplit(".", 1)[-1] for e in kept} == left_to_xla, report
    for entry in kept:
        assert entry.target == "TorchRMSNorm" and "per-head q/k norm before" in entry.reason
        assert "FluxAttnProcessor's apply_rotary_emb" in entry.reason, entry.reason
    unkernelize(model)


def test_two_models_in_one_process_can_differ(attention_calls):
    kernelized, inputs = tiny_flux()
    stock = copy.deepcopy(kernelized)
    with torch.no_grad():
        want = stock(**inputs, return_dict=False)[0]
        kernelize(kernelized, mode="inference")
        kernelized(**inputs, return_dict=False)
        calls = len(attention_calls)
        assert calls > 0
        assert torch.equal(stock(**inputs, return_dict=False)[0], want)
    assert len(attention_calls) == calls, "the stock model ran kernel-hub attention"


def tiny_sd3():
    torch.manual_seed(0)
    return SD3Transformer2DModel(
        sample_size=8,
        patch_size=1,
        in_channels=4,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=4,
        caption_projection_dim=32,
        joint_attention_dim=32,
        pooled_projection_dim=64,
        out_channels=4,
        pos_embed_max_size=16,
        qk_norm="rms_norm",
        dual_attention_layers=(0,),
    )


@pytest.mark.parametrize("make", ["sd3", "unet"])
def test_processors_calling_sdpa_directly_are_reported(make):
    if make == "sd3":
        model = tiny_sd3()
    else:
        model = UNet2DConditionModel(
            block_out_channels=(8, 16),
            layers_per_block=1,
            sample_size=8,
            in_channels=4,
            out_channels=4,
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=16,
            attention_head_dim=2,
            norm_num_groups=4,
        )
    report = kernelize(model, mode="inference")
    attention = [e for e in report.entries if e.kind == "attention"]
    assert attention and not any(e.swapped_to for e in attention)
    assert all("scaled_dot_product_attention itself" in e.reason for e in attention), report
    unkernelize(model)


def _backend_key():
    model, _ = tiny_flux()
    kernelize(model, mode="inference")
    key = next(m.processor._attention_backend for m in model.modules() if hasattr(m, "processor"))
    unkernelize(model)
    return key


def _native(q, k, v, **kwargs):
    return dispatch_attention_fn(q, k, v, backend="native", **kwargs)


@pytest.mark.parametrize(
    "case", ["plain", "key-padding-2d", "key-padding-4d", "additive-2d", "gqa", "causal", "scale"]
)
def test_backend_matches_native_dispatch(case):
    torch.manual_seed(1)
    batch, q_len, heads, dim = 2, 12, 4, 16
    kv_heads = 2 if case == "gqa" else heads
    q = torch.randn(batch, q_len, heads, dim, requires_grad=True)
    k = torch.randn(batch, q_len, kv_heads, dim, requires_grad=True)
    v = torch.randn(batch, q_len, kv_heads, dim, requires_grad=True)
    keep = torch.ones(batch, q_len, dtype=torch.bool)
    keep[1, 9:] = False
    kwargs = {
        "plain": {},
        "key-padding-2d": {"attn_mask": keep},
        "key-padding-4d": {"attn_mask": keep[:, None, None, :]},
        "additive-2d": {"attn_mask": torch.randn(batch, q_len)},
        "gqa": {"enable_gqa": True},
        "causal": {"is_causal": True},
        "scale": {"scale": 0.3},
    }[case]
    key = _backend_key()
    got = dispatch_attention_fn(q, k, v, backend=key, **kwargs)
    want = _native(q, k, v, **kwargs)
    assert max_errors(got.detach(), want.detach())[0] <= 1e-5
    grad = torch.randn_like(want)
    got_grads = torch.autograd.grad(got, (q, k, v), grad)
    want_grads = torch.autograd.grad(want, (q, k, v), grad)
    for g, w in zip(got_grads, want_grads, strict=True):
        assert max_errors(g, w)[0] <= 1e-5


def test_backend_dropout_runs_in_the_kernel_seeded_by_torch(caplog):
    """``dropout_p`` without a mask or with key padding runs the kernel's dropout (a seed per
    call from torch's generator: ``torch.manual_seed`` repeats it); a dense mask runs SDPA."""
    import logging

    key = _backend_key()
    q = torch.randn(2, 12, 4, 16)
    keep = torch.ones(2, 12, dtype=torch.bool)
    keep[1, 9:] = False

    def run(seed, **kwargs):
        torch.manual_seed(seed)
        return dispatch_attention_fn(q, q, q, backend=key, dropout_p=0.5, **kwargs)

    with caplog.at_level(logging.WARNING):
        for kwargs in ({}, {"attn_mask": keep}):
            first = run(0, **kwargs)
            assert torch.equal(first, run(0, **kwargs))
            assert not torch.equal(first, run(1, **kwargs))
            assert not torch.allclose(first, dispatch_attention_fn(q, q, q, backend=key, **kwargs))
    assert not caplog.text
    with caplog.at_level(logging.WARNING):
        run(0, attn_mask=torch.randn(2, 1, 12, 12))
    assert "with a dense attn_mask runs torch SDPA" in caplog.text


def test_backend_refuses_what_it_does_not_implement():
    key = _backend_key()
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(KernelInputError, match=r"does not implement .*'window_size'"):
        dispatch_attention_fn(q, q, q, backend=key, attention_kwargs={"window_size": (4, 4)})
    with pytest.raises(KernelInputError, match="return_lse"):
        dispatch_attention_fn(q, q, q, backend=key, attention_kwargs={"return_lse": True})
    with pytest.raises(KernelInputError, match="enable_gqa=True"):
        dispatch_attention_fn(q, q[:, :, :1], q[:, :, :1], backend=key)


def test_autocast_runs_attention_in_the_autocast_dtype():
    key = _backend_key()
    q = torch.randn(2, 8, 2, 16)
    with torch.autocast("cpu", torch.bfloat16):
        got = dispatch_attention_fn(q, q.bfloat16(), q, backend=key)
        want = _native(q, q.bfloat16(), q)
    assert got.dtype == want.dtype == torch.bfloat16
    assert max_errors(got, want)[0] <= 1e-2


def test_sd3_rmsnorms_swapped_and_match_stock():
    model = tiny_sd3()
    inputs = {
        "hidden_states": torch.randn(2, 4, 8, 8),
        "encoder_hidden_states": torch.randn(2, 6, 32),
        "pooled_projections": torch.randn(2, 64),
        "timestep": torch.tensor([3, 7]),
    }
    with torch.no_grad():
        stock = model(**inputs, return_dict=False)[0]
        report = kernelize(model, mode="inference")
        out = model(**inputs, return_dict=False)[0]
    rms = [e for e in report.entries if e.target == "DiffusersRMSNorm"]
    assert len(rms) == 10 and all(e.swapped_to for e in rms), report
    assert max_errors(out, stock)[0] <= TOLERANCE
    unkernelize(model)


def test_rmsnorm_variants_match_and_refuse_a_bias():
    from diffusers.models.normalization import RMSNorm

    layers = get_kernel("rmsnorm").layers
    torch.manual_seed(0)
    cases = [
        (torch.nn.RMSNorm(16), "TorchRMSNorm"),
        (torch.nn.RMSNorm((4, 4), eps=None), "TorchRMSNorm"),
        (torch.nn.RMSNorm(16, elementwise_affine=False), "TorchRMSNorm"),
        (RMSNorm(16, eps=1e-6), "DiffusersRMSNorm"),
        (RMSNorm(16, eps=1e-6, elementwise_affine=False), "DiffusersRMSNorm"),
    ]
    for norm, layer in cases:
        for dtype in (torch.float32, torch.bfloat16):
            module = copy.deepcopy(norm).to(dtype)
            if module.weight is not None:
                torch.nn.init.normal_(module.weight)
            assert layers.MODULE_CHECKS[layer](module) is None
            x = torch.randn(3, 5, 16).to(dtype)
            x = x.reshape(3, 5, 4, 4) if len(getattr(module, "normalized_shape", (16,))) == 2 else x
            want = module(x)
            got = getattr(layers, layer).forward(module, x)
            assert got.dtype == want.dtype, (norm, dtype)
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            assert max_errors(got.detach(), want.detach())[0] <= tol * 4, (norm, dtype)
    with_bias = RMSNorm(16, eps=1e-6, bias=True)
    assert "bias" in layers.MODULE_CHECKS["DiffusersRMSNorm"](with_bias)


@pytest.mark.slow
def test_kernelized_flux_compiles_fullgraph_with_backward(attention_calls):
    model, inputs = tiny_flux()
    stock_out, stock_grads = run(model, inputs)
    kernelize(model, mode="training+torch_compile")
    # fullgraph=True: a graph break raises, naming its reason
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    model.zero_grad()
    out = compiled(**inputs, return_dict=False)[0]
    out.square().mean().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert attention_calls and grads.keys() == stock_grads.keys()
    assert max_errors(out.detach(), stock_out)[0] <= TOLERANCE
    for name, grad in grads.items():
        assert max_errors(grad, stock_grads[name])[0] <= TOLERANCE, name
    unkernelize(model)


def test_a_processor_on_an_explicit_backend_keeps_it():
    from diffusers.models.attention_dispatch import AttentionBackendName

    model, _ = tiny_flux()
    chosen = model.transformer_blocks[0].attn.processor
    chosen._attention_backend = AttentionBackendName.FLASH
    report = kernelize(model, mode="inference")
    by_module = {e.module: e for e in report.entries if e.kind == "attention"}
    assert "set to attention backend 'flash'" in by_module["transformer_blocks.0.attn"].reason
    assert by_module["single_transformer_blocks.0.attn"].swapped_to, report
    unkernelize(model)
    assert chosen._attention_backend is AttentionBackendName.FLASH


def _attention_without_diffusers_adapter(directory):
    """The in-tree attention kernel as a build whose ``KERNEL`` declares no Diffusers adapter."""
    import shutil

    from kernel_hub.paths import kernels_dir

    target = directory / "attention"
    shutil.copytree(kernels_dir() / "attention", target, ignore=shutil.ignore_patterns("tests"))
    manifest = target / "kernel.yaml"
    text = manifest.read_text()
    version = next(line for line in text.splitlines() if line.startswith("version:"))
    manifest.write_text(text.replace(version, "version: 1.1.0"))
    init = target / "flash_attention" / "__init__.py"
    adapter = '        "diffusers": submodule_loader(__name__, "diffusers_backend"),\n'
    assert adapter in init.read_text()
    init.write_text(init.read_text().replace(adapter, ""))
    return target


@pytest.mark.slow
def test_a_kernel_without_a_diffusers_adapter_leaves_processors_alone_with_the_reason(
    tmp_path, monkeypatch
):
    """Every processor keeps its backend, and the report says why and what to load instead."""
    build = _attention_without_diffusers_adapter(tmp_path)
    monkeypatch.setenv("KERNEL_HUB_LOCAL_KERNELS", f"attention={build}")
    without = get_kernel("attention")
    assert str(without.manifest.version) == "1.1.0"
    assert without.KERNEL.integration("diffusers") is None
    model, inputs = tiny_flux()
    with torch.no_grad():
        want = model(**inputs, return_dict=False)[0]
        report = kernelize(model, mode="inference")
        got = model(**inputs, return_dict=False)[0]
    attention = [e for e in report.entries if e.kind == "attention"]
    assert attention and not any(e.swapped_to for e in attention), report
    reason = (
        "kernel attention 1.1.0 declares no Diffusers adapter (KERNEL.integrations['diffusers']): "
        "use a kernel that does"
    )
    assert all(reason in e.reason for e in attention), report
    assert not any("_attention_backend" in m.processor.__dict__ for m in _attention_modules(model))
    assert max_errors(got, want)[0] <= TOLERANCE  # its norms are swapped, exactly
    unkernelize(model)


def _attention_modules(model):
    return [m for m in model.modules() if hasattr(m, "processor")]
