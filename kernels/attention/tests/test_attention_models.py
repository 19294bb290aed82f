"""Architectures whose attention needs more than plain softmax, kernelized in training mode and
compared with the stock model: GPT-OSS (sinks), T5 (position_bias), DeepSeek-V3 (MLA head dims).

Each must end exact (f32 logits within 1e-4, every gradient within 1e-4 relative to its largest
entry), or left alone with a reason; these three are exact.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kernel_hub.layers.kernelize import kernelize  # noqa: E402
from kernel_hub.models.tiny import tiny_config  # noqa: E402


def _gpt_oss():
    """Sinks ~ N(0, 3), a realistic size; a sliding window on every other layer."""
    model = transformers.GptOssForCausalLM(
        tiny_config(
            transformers.GptOssConfig,
            intermediate_size=96,
            num_local_experts=4,
            num_experts_per_tok=2,
            head_dim=16,
            sliding_window=4,
        )
    )
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 3.0)
    return model


def _t5():
    config = tiny_config(
        transformers.T5Config,
        d_model=64,
        d_kv=16,
        d_ff=96,
        num_layers=2,
        num_heads=4,
        dropout_rate=0.0,
    )
    return transformers.T5ForConditionalGeneration(config)


def _deepseek_v3():
    """MLA: q/k head dim 16 + 8 (nope + rope), value head dim 12."""
    config = tiny_config(
        transformers.DeepseekV3Config,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_key_value_heads=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        first_k_dense_replace=1,
    )
    return transformers.DeepseekV3ForCausalLM(config)


BUILDERS = {"gpt-oss": _gpt_oss, "t5": _t5, "deepseek-v3": _deepseek_v3}


def _build(name: str):
    torch.manual_seed(0)
    return BUILDERS[name]().train()


def _batch():
    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    return ids, mask


def _step(model, ids, mask, encoder_decoder: bool):
    """Logits, loss and every gradient of one training step. The logits come from a forward
    without labels: with labels, kernelize's fused causal-LM loss returns no logits."""
    extra = {"decoder_input_ids": ids} if encoder_decoder else {}
    out = model(input_ids=ids, attention_mask=mask, labels=ids, **extra)
    out.loss.backward()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, **extra).logits
    grads = {n: p.grad for n, p in model.named_parameters()}
    return logits, out.loss.detach(), grads


def assert_grads_match(want: dict, got: dict, tolerance: float) -> None:
    for name, expected in want.items():
        if expected is None:
            assert got[name] is None, f"{name}: gradient where the stock model has none"
            continue
        assert got[name] is not None, f"{name}: no gradient (the stock model has one)"
        scale = expected.abs().max().clamp_min(1e-12)
        error = ((got[name] - expected).abs().max() / scale).item()
        assert error <= tolerance, f"{name}: gradient relative error {error:.3g}"


@pytest.mark.parametrize("name", list(BUILDERS))
def test_kernelized_training_step_matches_stock(attention, name):
    ids, mask = _batch()
    stock, model = _build(name), _build(name)
    report = kernelize(model, mode="training")
    attention_entries = [e for e in report.entries if e.kind == "attention"]
    assert attention_entries and all(e.swapped for e in attention_entries), report
    encoder_decoder = name == "t5"
    want_logits, want_loss, want_grads = _step(stock, ids, mask, encoder_decoder)
    got_logits, got_loss, got_grads = _step(model, ids, mask, encoder_decoder)
    rows = torch.ones_like(mask, dtype=torch.bool) if encoder_decoder else mask.bool()
    error = (got_logits - want_logits)[rows].abs().max().item()
    assert error <= 1e-4, f"{name}: logits max abs error {error:.3g}"
    assert abs(got_loss - want_loss).item() <= 1e-5 * want_loss.abs().item(), (got_loss, want_loss)
    assert_grads_match(want_grads, got_grads, 1e-4)
    if name == "gpt-oss":
        sinks = got_grads["model.layers.0.self_attn.sinks"]
        assert sinks.abs().max() > 0, "the sinks got no gradient"


@pytest.mark.slow
def test_gpt_oss_sinks_on_the_pallas_kernel(attention, request):
    """The same GPT-OSS step with the Pallas kernel (interpret mode) doing the attention."""
    ids, mask = _batch()
    stock, model = _build("gpt-oss"), _build("gpt-oss")
    kernelize(model, mode="training")  # applies the registry's implementation order ...
    pallas_first = request.getfixturevalue("pallas_first")  # ... which this then overrides
    want_logits, _, want_grads = _step(stock, ids, mask, False)
    got_logits, _, got_grads = _step(model, ids, mask, False)
    assert pallas_first, "the Pallas kernel did not run"
    error = (got_logits - want_logits)[mask.bool()].abs().max().item()
    assert error <= 1e-4, f"logits max abs error {error:.3g}"
    sinks = {n: g for n, g in want_grads.items() if n.endswith("sinks")}
    assert_grads_match(sinks, got_grads, 1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(BUILDERS))
def test_kernelized_greedy_generation_matches_stock(attention, name):
    """Cached decoding (one query over the cache; T5's bias sliced to the new position)."""
    ids, mask = _batch()
    outputs = []
    for kernelized in (False, True):
        model = _build(name).eval()
        if kernelized:
            kernelize(model, mode="inference")
        with torch.no_grad():
            outputs.append(
                model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    max_new_tokens=5,
                    do_sample=False,
                    pad_token_id=0,
                    decoder_start_token_id=0,
                )
            )
    assert torch.equal(*outputs), outputs


def _gemma2_dropout():
    config = tiny_config(
        transformers.Gemma2Config,
        intermediate_size=96,
        head_dim=16,
        attn_logit_softcapping=50.0,
        attention_dropout=0.1,
    )
    return transformers.Gemma2ForCausalLM(config)


def _gpt_oss_dropout():
    model = _gpt_oss()
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    return model


DROPOUT = {"gemma2-softcap": _gemma2_dropout, "gpt-oss-sinks": _gpt_oss_dropout}


@pytest.mark.parametrize("name", list(DROPOUT))
def test_dropout_with_softcap_or_sinks_trains_on_the_kernel(attention, name):
    """Attention dropout runs in the kernel beside soft-capping and sinks: a training kernelize
    swaps the attention, a training step runs, and ``torch.manual_seed`` reproduces its loss
    (the masks' seeds come from torch's generator) while another seed changes it."""
    model = DROPOUT[name]().train()
    report = kernelize(model, mode="training")
    entries = [e for e in report.entries if e.kind == "attention"]
    assert entries and all(e.swapped for e in entries), report
    ids, mask = _batch()

    def loss(seed):
        torch.manual_seed(seed)
        return model(input_ids=ids, attention_mask=mask, labels=ids).loss

    first = loss(0)
    first.backward()
    assert all(p.grad is None or bool(p.grad.isfinite().all()) for p in model.parameters())
    assert loss(0).item() == first.item()
    assert loss(1).item() != first.item()
