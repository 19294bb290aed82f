"""Tiny models with the masks real batches need, on the Pallas kernel (interpret mode) against
stock SDPA in f32: padded batches (left and right), sliding windows (Mistral, Gemma 3), chunked
attention (Llama 4), image tokens attending bidirectionally (Gemma 3), an encoder-decoder with
cross-attention (Whisper), a two-way local window (ModernBERT), Mllama's own cross-attention mask
over image tiles (read as nested key sets, ``describe_nested``). Training mode, forward and
backward: logits within 1e-4, every gradient within 1e-4 x max(1, its largest entry); the flash op
ran with a ``MaskDescription`` and the dense-mask op never did. Greedy generation from a
left-padded prompt with a static cache equals stock."""

from __future__ import annotations

import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kernel_hub.models import tiny  # noqa: E402

LENGTH = 12


def _padding(batch: int = 2, length: int = LENGTH, left: int = 3, right: int = 2):
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[0, :left] = 0
    mask[1, length - right :] = 0
    return mask


def _token_inputs():
    ids = torch.randint(8, tiny.VOCAB_SIZE, (2, LENGTH), generator=torch.Generator().manual_seed(1))
    mask = _padding()
    return {"input_ids": ids * mask, "attention_mask": mask}, mask.bool()


def _gemma3_inputs():
    """One image (4 tokens) per row, after 3 left-padding tokens in row 0."""
    inputs, rows = _token_inputs()
    ids = inputs["input_ids"]
    ids[0, 4:8] = tiny.GEMMA3_IMAGE_TOKEN
    ids[1, 1:5] = tiny.GEMMA3_IMAGE_TOKEN
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    token_types = (ids == tiny.GEMMA3_IMAGE_TOKEN).long()
    return {**inputs, "pixel_values": pixels, "token_type_ids": token_types}, rows


def _whisper_inputs():
    features = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(2))
    decoder = torch.randint(3, tiny.VOCAB_SIZE, (2, 8), generator=torch.Generator().manual_seed(1))
    mask = _padding(length=8, left=0, right=3)
    inputs = {
        "input_features": features,
        "decoder_input_ids": decoder,
        "decoder_attention_mask": mask,
    }
    return inputs, mask.bool()


MLLAMA_IMAGE_TOKEN = 5


def _mllama(seed: int = 0) -> torch.nn.Module:
    """Mllama: a self-attention layer and a cross-attention layer over a 2-tile 16x16 image
    tower (1-D parameters, the tanh gates among them, drawn around 1 so the cross-attention
    output reaches the logits)."""
    text = tiny.tiny_config(
        transformers.MllamaTextConfig,
        intermediate_size=96,
        cross_attention_layers=[1],
        pad_token_id=tiny.PAD_TOKEN_ID,
        max_position_embeddings=128,
    )
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_global_layers=1,
        attention_heads=2,
        image_size=16,
        patch_size=8,
        max_num_tiles=2,
        intermediate_layers_indices=[0],
        vision_output_dim=64,
        supported_aspect_ratios=[[1, 1], [1, 2], [2, 1]],
    )
    config = transformers.MllamaConfig(
        text_config=text, vision_config=vision, image_token_index=MLLAMA_IMAGE_TOKEN
    )
    torch.manual_seed(seed)
    model = transformers.MllamaForConditionalGeneration(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 1:
                parameter.normal_(1.0, 0.2)
    return model


def _mllama_inputs():
    """One image per row: row 0 (3 left-padding tokens) with both tiles, row 1 with one tile
    and a padded one. Tokens before the image see no tile (Mllama then unmasks the row)."""
    inputs, rows = _token_inputs()
    ids = inputs["input_ids"]
    ids[0, 4] = ids[1, 1] = MLLAMA_IMAGE_TOKEN
    cross = torch.zeros(2, LENGTH, 1, 2, dtype=torch.long)
    cross[0, 4:, 0, :] = 1
    cross[1, 1:, 0, :1] = 1
    images = {
        "pixel_values": torch.randn(2, 1, 2, 3, 16, 16, generator=torch.Generator().manual_seed(2)),
        "aspect_ratio_ids": torch.tensor([[2], [1]]),
        "aspect_ratio_mask": torch.tensor([[[1, 1]], [[1, 0]]]),
        "cross_attention_mask": cross,
    }
    return {**inputs, **images}, rows


MODELS = {
    "llama": _token_inputs,
    "mistral": _token_inputs,
    "llama4_text": _token_inputs,
    "gemma3": _gemma3_inputs,
    "whisper": _whisper_inputs,
    "modernbert": _token_inputs,
    "mllama": _mllama_inputs,
}
BUILDERS = {"mllama": _mllama}
"""Models built here rather than by ``tiny.build_tiny_model``."""


@pytest.fixture(scope="module")
def kernel_name(attention):
    return attention.KERNEL.integration("transformers").register()


@pytest.fixture
def op_calls(attention, monkeypatch):
    """Counts the integration's calls of each torch op, and which masks reached the flash op."""
    integrations = attention.KERNEL.integration("transformers")
    calls = {"flash": 0, "described": 0, "dense": 0}
    flash, dense = integrations.attention_with_lse, integrations.attention_with_dense_mask
    flash_out = integrations.dot_product_attention

    def counting_flash(*args, **kwargs):
        calls["flash"] += 1
        return flash(*args, **kwargs)

    def counting_flash_out(*args, **kwargs):
        calls["flash"] += 1
        return flash_out(*args, **kwargs)

    def counting_dense(*args, **kwargs):
        calls["dense"] += 1
        return dense(*args, **kwargs)

    described = integrations._described_attention

    def counting_described(*args, **kwargs):
        calls["described"] += 1
        return described(*args, **kwargs)

    monkeypatch.setattr(integrations, "attention_with_lse", counting_flash)
    monkeypatch.setattr(integrations, "dot_product_attention", counting_flash_out)
    monkeypatch.setattr(integrations, "attention_with_dense_mask", counting_dense)
    monkeypatch.setattr(integrations, "_described_attention", counting_described)
    return calls


def _step(model, implementation: str, inputs: dict, rows: torch.Tensor):
    """Logits at the real rows and every parameter's gradient of a fixed projection of them."""
    model.zero_grad()
    model.set_attn_implementation(implementation)
    logits = model(**inputs).logits[rows]
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(3))
    (logits * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


@pytest.mark.parametrize("name", list(MODELS))
def test_padded_training_step_matches_sdpa(
    attention, pallas_first, kernel_name, op_calls, caplog, name
):
    model = (BUILDERS[name]() if name in BUILDERS else tiny.build_tiny_model(name)).train()
    inputs, rows = MODELS[name]()
    with caplog.at_level(logging.WARNING):
        got_logits, got_grads = _step(model, kernel_name, inputs, rows)
    assert pallas_first, "the Pallas kernel did not run"
    assert op_calls["described"] and op_calls["flash"], op_calls
    assert op_calls["dense"] == 0, f"{name}: the dense-mask op ran ({op_calls})"
    assert "dense mask" not in caplog.text and "reference" not in caplog.text, caplog.text
    want_logits, want_grads = _step(model, "sdpa", inputs, rows)
    error = (got_logits - want_logits).abs().max().item()
    assert error <= 1e-4, f"{name}: logits max abs error {error:.3g}"
    assert want_grads.keys() == got_grads.keys()
    for parameter, want in want_grads.items():
        scale = want.abs().max().clamp_min(1.0)  # absolute below 1, relative above
        error = ((got_grads[parameter] - want).abs().max() / scale).item()
        assert error <= 1e-4, f"{name} {parameter}: gradient error {error:.3g} (of max(1, |g|))"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "mistral", "llama4_text", "gemma3", "mllama"])
def test_left_padded_static_cache_generation_matches_sdpa(
    attention, pallas_first, kernel_name, op_calls, name
):
    """Mllama: cross-attention over the image tiles beside a static self-attention cache."""
    model = BUILDERS[name]() if name in BUILDERS else tiny.build_tiny_model(name)
    inputs, _ = MODELS[name]()
    inputs["attention_mask"][1] = 1  # left padding only, as generation wants
    outputs = {}
    for implementation in ("sdpa", kernel_name):
        model.set_attn_implementation(implementation)
        with torch.no_grad():
            outputs[implementation] = model.generate(
                **inputs,
                max_new_tokens=5,
                do_sample=False,
                pad_token_id=tiny.PAD_TOKEN_ID,
                cache_implementation="static",
            )
    assert pallas_first, "the Pallas kernel did not run"
    assert op_calls["dense"] == 0, op_calls
    assert torch.equal(outputs["sdpa"], outputs[kernel_name]), outputs
