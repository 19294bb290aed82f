"""Tiny Transformers models with attention on the kernel (Pallas, interpret mode) against SDPA."""

from __future__ import annotations

import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import Gemma2ForCausalLM, Qwen2ForCausalLM  # noqa: E402

from kernel_hub.models.tiny import build_tiny_model, tiny_model  # noqa: E402


def _llama():
    return build_tiny_model("llama")


def _mixtral():
    """Mixtral with a 5-token sliding window, so 12-token inputs need the window mask."""
    model = build_tiny_model("mixtral")
    model.config.sliding_window = 5
    return model


def _qwen2():
    """Layer 0 full attention, layer 1 sliding window (Qwen2's max_window_layers)."""
    return tiny_model(
        Qwen2ForCausalLM, use_sliding_window=True, sliding_window=4, max_window_layers=1
    )


def _inputs(batch=2, length=12, left_padding=3):
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (batch, length), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, :left_padding] = 0
    return ids, mask


@pytest.fixture(scope="module")
def kernel_name(attention):
    return attention.KERNEL.integration("transformers").register()


def _logits(model, implementation, **inputs):
    model.set_attn_implementation(implementation)
    with torch.no_grad():
        return model(**inputs).logits


def _max_error(a, b) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("build", [_llama, _mixtral, _qwen2], ids=["llama", "mixtral", "qwen2"])
@pytest.mark.parametrize("padded", [False, True], ids=["full", "left-padded"])
def test_logits_match_sdpa(attention, pallas_first, kernel_name, caplog, build, padded):
    model = build()
    ids, mask = _inputs()
    inputs = {"input_ids": ids, "attention_mask": mask if padded else None}
    with caplog.at_level(logging.WARNING):
        got = _logits(model, kernel_name, **inputs)
    assert pallas_first, "the Pallas kernel did not run"
    assert "reference implementation" not in caplog.text, "the mask fell back to the reference"
    want = _logits(model, "sdpa", **inputs)
    real = mask.bool() if padded else torch.ones_like(mask, dtype=torch.bool)
    error = _max_error(got[real], want[real])
    assert error <= 1e-4, f"logits max abs error {error:.3g} vs sdpa"


@pytest.mark.slow
@pytest.mark.parametrize("build", [_llama, _mixtral], ids=["llama", "mixtral"])
def test_greedy_generate_matches_sdpa(attention, pallas_first, kernel_name, build):
    model = build()
    ids, mask = _inputs()
    outputs = {}
    for implementation in ("sdpa", kernel_name):
        model.set_attn_implementation(implementation)
        with torch.no_grad():
            outputs[implementation] = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=4,
                do_sample=False,
                pad_token_id=0,
            )
    assert pallas_first, "the Pallas kernel did not run"
    assert torch.equal(outputs["sdpa"], outputs[kernel_name]), outputs


def test_training_step_gradients_match_sdpa(attention, pallas_first, kernel_name):
    ids, mask = _inputs()
    grads = {}
    for implementation in ("sdpa", kernel_name):
        model = _llama().train()
        model.set_attn_implementation(implementation)
        model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
        grads[implementation] = {n: p.grad for n, p in model.named_parameters()}
    assert pallas_first, "the Pallas kernel did not run"
    for name, want in grads["sdpa"].items():
        error = _max_error(grads[kernel_name][name], want)
        assert error <= 1e-4, f"{name}: gradient max abs error {error:.3g}"


def test_torch_compile_fullgraph_has_no_graph_breaks(attention, pallas_first, kernel_name):
    model = _llama()
    model.set_attn_implementation(kernel_name)
    ids, mask = _inputs()
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(model)(input_ids=ids, attention_mask=mask)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    with torch.no_grad():
        got = compiled(input_ids=ids, attention_mask=mask).logits
    assert pallas_first, "the Pallas kernel did not run"
    want = _logits(model, "sdpa", input_ids=ids, attention_mask=mask)
    error = _max_error(got[mask.bool()], want[mask.bool()])
    assert error <= 1e-4, f"compiled logits max abs error {error:.3g}"


def test_gemma2_softcap_and_window_match_eager(attention, pallas_first, kernel_name):
    model = tiny_model(
        Gemma2ForCausalLM,
        head_dim=16,
        sliding_window=4,
        attn_logit_softcapping=3.0,
        query_pre_attn_scalar=16,
    )
    ids, mask = _inputs()
    got = _logits(model, kernel_name, input_ids=ids, attention_mask=mask)
    assert pallas_first, "the Pallas kernel did not run"
    want = _logits(model, "eager", input_ids=ids, attention_mask=mask)
    error = _max_error(got[mask.bool()], want[mask.bool()])
    assert error <= 1e-4, f"logits max abs error {error:.3g} vs eager"


def test_fully_masked_rows_follow_eager_in_an_eager_model(attention, pallas_first, kernel_name):
    """Gemma 2 runs eager attention: a left-padding query row that sees no key averages every
    value there (SDPA, and the kernel, give zeros). Switched as kernelize switches it (each
    attention module's ``module_problem`` first, which notes the implementation it ran), a
    training step whose loss also covers the padding (labels not -100) gives eager's loss and
    gradients on the kernel."""
    integration = attention.KERNEL.integration("transformers")
    model = tiny_model(
        Gemma2ForCausalLM,
        intermediate_size=96,
        head_dim=16,
        sliding_window=4,
        attn_logit_softcapping=3.0,
        pad_token_id=0,
    ).train()
    assert model.config._attn_implementation == "eager"
    ids, mask = _inputs()
    ids = ids * mask

    def step():
        model.zero_grad()
        loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return loss.detach(), grads

    want_loss, want_grads = step()
    for layer in model.model.layers:
        assert integration.module_problem(layer.self_attn) is None
    model.set_attn_implementation(kernel_name)
    got_loss, got_grads = step()
    assert pallas_first, "the Pallas kernel did not run"
    assert abs(got_loss - want_loss).item() <= 1e-5, (got_loss, want_loss)
    for name, want in want_grads.items():
        error = ((got_grads[name] - want).abs().max() / want.abs().max().clamp_min(1.0)).item()
        assert error <= 1e-4, f"{name}: gradient error {error:.3g}"


def test_packed_sequences_run_on_the_kernel(attention, pallas_first, kernel_name, caplog):
    model = _llama()
    ids, _ = _inputs(batch=1)
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]])
    with caplog.at_level(logging.WARNING):
        got = _logits(model, kernel_name, input_ids=ids, position_ids=position_ids)
    assert pallas_first, "the Pallas kernel did not run"
    assert "reference implementation" not in caplog.text, "packed mask fell back to the reference"
    want = _logits(model, "sdpa", input_ids=ids, position_ids=position_ids)
    error = _max_error(got, want)
    assert error <= 1e-4, f"logits max abs error {error:.3g}"


def test_unexpressible_mask_falls_back_with_reason(attention, caplog):
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 6, 8, generator=generator)
    k = torch.randn(1, 2, 6, 8, generator=generator)
    mask = torch.rand(1, 1, 6, 6, generator=generator) > 0.4
    mask[..., 0] = True
    module = torch.nn.Module()
    attention.dense_mask._warn_once.cache_clear()  # the warning is given once per reason
    with caplog.at_level(logging.WARNING):
        got, weights = attention.KERNEL.integration("transformers").attention_forward(
            module, q, k, k, mask
        )
    assert weights is None
    assert "dense mask ran on the reference implementation" in caplog.text
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k, k, attn_mask=mask, enable_gqa=True
    )
    error = _max_error(got, want.transpose(1, 2))
    assert error <= 1e-5, f"max abs error {error:.3g}"


def test_additive_masks(attention, caplog):
    """0 / finfo.min masks (eager style) run on the kernel; real biases fall back, exactly."""
    generator = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, 6, 8, generator=generator)
    k = torch.randn(2, 2, 6, 8, generator=generator)
    allowed = torch.ones(6, 6, dtype=torch.bool).tril().expand(2, 1, 6, 6).clone()
    allowed[0, ..., :2] = False  # left padding of two keys in batch 0
    binary = torch.zeros(2, 1, 6, 6).masked_fill(~allowed, torch.finfo(torch.float32).min)
    biased = binary + torch.randn(2, 1, 6, 6, generator=generator)
    # SDPA averages all values in a row that sees no key; the kernel gives zeros there.
    rows = allowed.any(-1).squeeze(1)
    attention.dense_mask._warn_once.cache_clear()
    for mask, falls_back in ((binary, False), (biased, True)):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            got, _ = attention.KERNEL.integration("transformers").attention_forward(
                torch.nn.Module(), q, k, k, mask
            )
        assert ("reference implementation" in caplog.text) == falls_back, caplog.text
        want = torch.nn.functional.scaled_dot_product_attention(
            q, k, k, attn_mask=mask, enable_gqa=True
        ).transpose(1, 2)
        error = _max_error(got[rows], want[rows])
        assert error <= 1e-5, f"max abs error {error:.3g} (falls back: {falls_back})"
    assert "additive mask with values other than 0" in caplog.text


def test_dropout_runs_in_the_kernel_and_under_a_dense_mask_on_torch_sdpa(attention, caplog):
    """Without a mask the kernel drops (no warning; a seed per call from torch's generator, so
    ``torch.manual_seed`` repeats it); a dense 4-D mask has no kernel path with dropout: torch
    SDPA runs with its own dropout, and a warning says why."""
    forward = attention.KERNEL.integration("transformers").attention_forward
    generator = torch.Generator().manual_seed(5)
    q = torch.randn(1, 4, 6, 8, generator=generator)
    k = torch.randn(1, 2, 6, 8, generator=generator)
    runs = []
    with caplog.at_level(logging.WARNING):
        for seed in (0, 0, 1):
            torch.manual_seed(seed)
            runs.append(forward(torch.nn.Module(), q, k, k, None, 0.5)[0])
    assert not caplog.text
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])
    undropped = forward(torch.nn.Module(), q, k, k, None)[0]
    assert not torch.allclose(runs[0], undropped)
    dense = torch.ones(1, 1, 6, 6, dtype=torch.bool).tril()
    torch.manual_seed(0)
    with caplog.at_level(logging.WARNING):
        got, _ = forward(torch.nn.Module(), q, k, k, dense, 0.5)
    assert "with a dense mask or a position bias runs torch SDPA" in caplog.text
    torch.manual_seed(0)
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k, k, attn_mask=dense, dropout_p=0.5, enable_gqa=True
    )
    assert torch.equal(got, want.transpose(1, 2))


def test_kernelize_switches_attention_to_the_kernel(attention):
    from kernel_hub.layers.kernelize import kernelize, unkernelize

    model = _llama()
    ids, mask = _inputs()
    want = _logits(model, "sdpa", input_ids=ids, attention_mask=mask)
    report = kernelize(model, mode="inference+torch_compile")
    switched = [e for e in report.entries if e.kind == "attention"]
    assert switched and all(e.swapped for e in switched), report
    assert (
        model.config._attn_implementation
        == attention.KERNEL.integration("transformers").DEFAULT_NAME
    )
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask).logits
    unkernelize(model)
    error = _max_error(got[mask.bool()], want[mask.bool()])
    assert error <= 1e-4, f"kernelized logits max abs error {error:.3g}"


def test_bad_sliding_window_is_rejected(attention):
    from kernel_hub.errors import KernelInputError

    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(KernelInputError, match="sliding_window=0"):
        attention.KERNEL.integration("transformers").attention_forward(
            torch.nn.Module(), q, q, q, None, sliding_window=0
        )
