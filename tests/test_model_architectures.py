"""``kernel_hub.models.architectures``: composites shrink each sub-config, text heads take their
own config class, strict config rules are met, exclusions carry a reason, and each family gets
the inputs it needs (left-padded speech LMs, Gemma 3's image-token layout)."""

from __future__ import annotations

import pytest
import torch

from kernel_hub.models import architectures as archs


def _arch(model_type: str) -> archs.Architecture:
    return next(a for a in archs.architectures() if a.model_type == model_type)


def _parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_a_composite_shrinks_its_auto_config_sub_config():
    """Gemma 3 declares its vision tower as AutoConfig: the SigLIP default is shrunk too."""
    model = archs.build(_arch("gemma3"))
    config = model.config
    assert config.vision_config.hidden_size == 64 and config.vision_config.image_size == 32
    assert config.text_config.hidden_size == 64 and config.text_config.vocab_size == 128
    assert _parameters(model) <= archs.MAX_PARAMETERS


def test_a_text_head_is_built_from_its_own_config_class():
    """Llama 4's causal LM takes the text sub-config, not the multimodal composite."""
    model = archs.build(_arch("llama4"))
    assert type(model.config).__name__ == "Llama4TextConfig"
    assert _parameters(model) <= archs.MAX_PARAMETERS


def test_strict_layer_type_rules_get_a_cut_layer_list_with_every_kind():
    """Zamba 2 validates len(layer_types) == num_hidden_layers as it is built; the default
    stack cut to two layers must keep its hybrid (attention) kind."""
    config = archs.build(_arch("zamba2")).config
    assert len(config.layer_types) == config.num_hidden_layers == 2
    assert set(config.layer_types) == {"linear_attention", "hybrid"}


def test_vision_language_towers_and_projectors_shrink():
    """Qwen3-VL's vision tower (27 blocks, merged into 3584 wide) and Cohere 2 Vision's
    36864-wide projector are cut to the tiny sizes; GLM-4V's mRoPE sections fit the tiny head."""
    vision = archs.build(_arch("qwen3_vl")).config.vision_config
    assert (vision.depth, vision.out_hidden_size) == (2, 64)
    cohere = archs.build(_arch("cohere2_vision"))
    assert cohere.config.alignment_intermediate_size == 96
    assert _parameters(cohere) <= archs.MAX_PARAMETERS
    glm = archs.build(_arch("glm4v"))
    assert sum(glm.config.text_config.rope_parameters["mrope_section"]) == 8
    assert _parameters(glm) <= archs.MAX_PARAMETERS


def test_excluded_architectures_say_why():
    with pytest.raises(archs.NotBuilt, match="shared key/value states"):
        archs.build(_arch("gemma4_assistant"))


def test_speech_language_models_are_fed_as_left_padded_decoders():
    """Qwen2-Audio is listed as sequence-to-sequence but is a decoder: no decoder_input_ids."""
    arch = _arch("qwen2_audio")
    inputs = archs.batch(arch, archs.build(arch))
    assert "decoder_input_ids" not in inputs
    assert inputs["attention_mask"][-1, : archs.PADDING].eq(0).all()


def test_gemma3_gets_one_image_per_row_after_the_padding():
    arch = _arch("gemma3")
    model = archs.build(arch)
    inputs = archs.batch(arch, model)
    images = inputs["input_ids"] == archs.IMAGE_TOKEN_ID
    assert images.sum(1).tolist() == [archs.IMAGE_TOKENS] * archs.BATCH
    assert not (images & inputs["attention_mask"].eq(0)).any(), "an image token in the padding"
    assert torch.equal(inputs["token_type_ids"], images.long())
    with torch.no_grad():
        with_image = model(**inputs).logits
        inputs["pixel_values"] = torch.randn(inputs["pixel_values"].shape)
        other_image = model(**inputs).logits
    assert not torch.allclose(with_image, other_image), "the pixel values were not used"


@pytest.mark.parametrize("model_type", ["paligemma", "qwen2_vl", "llava_next"])
def test_vision_language_models_get_as_many_placeholders_as_image_features(model_type):
    """PaliGemma marks its prefix-LM prefix (image + prompt) with token type 0; Qwen2-VL marks
    image tokens for its mRoPE positions; LLaVA-Next's count includes its tile and newlines."""
    arch = _arch(model_type)
    model = archs.build(arch)
    inputs = archs.batch(arch, model)
    images = inputs["input_ids"] == archs.IMAGE_TOKEN_ID
    count = archs._image_token_count(
        model, archs.IMAGE_INPUTS[model_type].pixels(model.config, torch.Generator())
    )
    assert images.sum(1).tolist() == [count] * archs.BATCH
    assert not (images & inputs["attention_mask"].eq(0)).any(), "an image token in the padding"
    if model_type == "paligemma":
        prefix = inputs["token_type_ids"].eq(0)
        assert prefix[images].all(), "an image token in the suffix"
        assert (~prefix).any(1).all(), "a row without a suffix"
    if model_type == "qwen2_vl":
        assert torch.equal(inputs["mm_token_type_ids"], images.long())
    pixels = next(k for k in inputs if k.startswith("pixel"))
    with torch.no_grad():
        with_image = archs.main_output(model(**inputs))
        inputs[pixels] = torch.randn(inputs[pixels].shape)
        other_image = archs.main_output(model(**inputs))
    assert not torch.allclose(with_image, other_image), "the pixel values were not used"


def test_speech_seq2seq_decoders_get_a_right_padded_row_compared_on_real_rows():
    arch = next(a for a in archs.architectures(("speech-seq2seq",)) if a.model_type == "whisper")
    model = archs.build(arch)
    inputs = archs.batch(arch, model)
    mask = inputs["decoder_attention_mask"]
    assert (
        mask[0].all()
        and mask[-1].tolist() == [1] * (archs.DECODER_LEN - archs.PADDING) + [0] * archs.PADDING
    )
    with torch.no_grad():
        logits = archs.main_output(model(**inputs))
    assert torch.equal(archs.real_positions(inputs, logits), mask.bool())
