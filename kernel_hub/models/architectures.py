"""Every Transformers architecture of a few families, as a tiny random-weight model and a batch.

Architectures come from Transformers' own auto mappings (one model class per ``model_type``, the
first family that lists it wins), never from a hand-written list, so a new Transformers release
brings its new architectures with it. A tiny config is the config class's defaults with the
size fields it has (``hidden_size``, ``num_layers``, ``num_heads``, ``d_ff``, experts, ...)
shrunk to the same small values, every dropout at zero (training-mode runs are deterministic)
and special token ids inside the small vocabulary. An architecture whose tiny config cannot be
built, is still large, or whose stock forward fails is reported with the reason, not hidden.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .families import FAMILIES

VOCAB_SIZE = 128
PAD_TOKEN_ID = 0
BATCH, SEQ_LEN, PADDING = 2, 12, 3
DECODER_LEN = 8
IMAGE_SIZE = 32
AUDIO_SAMPLES = 1600
IMAGE_TOKEN_ID, IMAGE_TOKENS = 5, 4
"""A composite's image placeholder token (inside the tiny vocabulary) and Gemma 3's tokens per
image."""
MAX_PARAMETERS = 3_000_000
"""Architectures whose shrunk config still has more parameters are skipped as not tiny."""


_SIZES: dict[str, Any] = {
    **dict.fromkeys(("vocab_size",), VOCAB_SIZE),
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "n_embed", "embed_dim", "dim"), 64),
    **dict.fromkeys(
        (
            "num_hidden_layers",
            "num_layers",
            "n_layer",
            "n_layers",
            "encoder_layers",
            "decoder_layers",
            "num_decoder_layers",
            "num_encoder_layers",
            "depth",  # vision towers (Qwen3-VL's 27 blocks, GLM-4V's 24)
        ),
        2,
    ),
    **dict.fromkeys(
        (
            "num_attention_heads",
            "num_heads",
            "n_head",
            "n_heads",
            "encoder_attention_heads",
            "decoder_attention_heads",
        ),
        4,
    ),
    **dict.fromkeys(("num_key_value_heads",), 2),
    **dict.fromkeys(("head_dim", "d_kv", "attention_head_dim"), 16),
    **dict.fromkeys(
        ("intermediate_size", "d_ff", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "n_inner"),
        96,
    ),
    **dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size"), 32),
    **dict.fromkeys(("num_local_experts", "num_experts", "n_routed_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk"), 2),
    **dict.fromkeys(("n_group", "topk_group", "first_k_dense_replace"), 1),
    # multi-head latent attention (DeepSeek-V2/V3): value head dim differs from query/key's
    **dict.fromkeys(("q_lora_rank",), 32),
    **dict.fromkeys(("kv_lora_rank", "qk_nope_head_dim"), 16),
    **dict.fromkeys(("qk_rope_head_dim",), 8),
    **dict.fromkeys(("v_head_dim",), 12),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "max_target_positions"), 128),
    **dict.fromkeys(("max_source_positions",), 32),
    **dict.fromkeys(("image_size",), IMAGE_SIZE),
    **dict.fromkeys(("patch_size",), 8),
    **dict.fromkeys(("pad_token_id", "decoder_start_token_id"), PAD_TOKEN_ID),
    **dict.fromkeys(("bos_token_id",), 1),
    **dict.fromkeys(("eos_token_id", "sep_token_id", "cls_token_id"), 2),
    **dict.fromkeys(("sliding_window",), 8),
    # other names for the sizes above (Gemma 4's per-layer embeddings, Inkling's sliding-window
    # heads, XLM's embedding, CPM-Ant's and Funnel's MLPs, RoCBert's and LUKE's extra
    # vocabularies, FSMT's two vocabularies, DBRX's/LongCat's/Dots' experts, BLT's hash table)
    **dict.fromkeys(
        (
            "vocab_size_per_layer_input",
            "unpadded_vocab_size",
            "src_vocab_size",
            "tgt_vocab_size",
            "shape_vocab_size",
            "pronunciation_vocab_size",
            "entity_vocab_size",
            "encoder_hash_byte_group_vocab",
        ),
        VOCAB_SIZE,
    ),
    **dict.fromkeys(("emb_dim", "hidden_size_global"), 64),
    **dict.fromkeys(("swa_num_attention_heads",), 4),
    **dict.fromkeys(("swa_num_key_value_heads",), 2),
    **dict.fromkeys(("swa_head_dim", "dim_head"), 16),
    **dict.fromkeys(("shape_embed_dim", "pronunciation_embed_dim", "entity_emb_size"), 16),
    **dict.fromkeys(("dim_ff", "d_inner", "ffn_hidden_size"), 96),
    **dict.fromkeys(("expert_ffn_hidden_size",), 32),
    # vision-language projectors: a vision tower's output (merged into the text's width) and
    # the projector's own widths (Qwen3-VL's and GLM-4V's 3584 / 4096, Cohere 2 Vision's 36864)
    **dict.fromkeys(("out_hidden_size", "projector_hidden_size"), 64),
    **dict.fromkeys(("alignment_intermediate_size",), 96),
    **dict.fromkeys(("zero_expert_num", "n_shared_experts"), 1),
    # hybrids (Bamba, Jamba): one attention layer of the two, so the cache has one
    "attn_layer_indices": [1],
    "attn_layer_period": 2,
    "attn_layer_offset": 1,
    **dict.fromkeys(
        ("router_jitter_noise", "layerdrop", "encoder_layerdrop", "decoder_layerdrop"), 0.0
    ),
}
"""Config field -> tiny value, applied where the config class has that field."""

_QWEN4_INDEXER = dict(
    indexer_n_heads=2,
    indexer_kv_heads=1,
    indexer_head_dim=16,
    indexer_budget=8,
    indexer_compress_ratio=4,
)

_GEMMA3_IMAGES = dict(
    mm_tokens_per_image=IMAGE_TOKENS,
    image_token_index=IMAGE_TOKEN_ID,
    boi_token_index=6,
    eoi_token_index=7,
)

# vision-language models: the image placeholder inside the tiny vocabulary, under either name
_IMAGE_TOKEN = {"image_token_id": IMAGE_TOKEN_ID, "image_token_index": IMAGE_TOKEN_ID}
# Qwen2-VL's vision tower: 32 blocks and a 3584-wide merger output by default
# and mRoPE sections (temporal, height, width) that split the tiny head's 8 rotary frequencies
_QWEN_VL = {
    **_IMAGE_TOKEN,
    "depth": 2,
    "out_hidden_size": 64,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
}

# GLM-4V's mRoPE sections must sum to 8 for the tiny head (4 for GLM-4.5V's MoE text model,
# rotary factor 0.5); the defaults [8, 12, 12] fit a 128-wide head
_GLM4V = {
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
}
_GLM4V_MOE = {
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        "mrope_section": [1, 1, 2],
    }
}

# VQ image tokenizers (Janus, Chameleon): a codebook of 16384 / 8192 codes, 2048-wide
# aligners, five stages of 128 to 512 channels by default
_VQ_IMAGES = {
    "projection_dim": 64,
    "num_embeddings": VOCAB_SIZE,
    "image_token_embed_dim": 64,
    "latent_channels": 32,
    "base_channels": 32,
    "channel_multiplier": [1, 2],
    "num_res_blocks": 1,
}
_SAM_NECK = {
    "output_channels": 32,
    "mlp_dim": 96,
    "downsample_channels": [32, 64],
    "post_conv_in_channels": 32,
    "post_conv_mid_channels": 32,
    "post_conv_out_channels": 64,
}

ARCHITECTURE_FIELDS: dict[str, dict[str, Any]] = {
    # its per-layer attention kinds ([[kinds, repeats]]) must cover exactly num_layers
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},
    # Mamba-2: heads x head_dim must equal expand (2) x hidden_size
    "mamba2": {"num_heads": 8},
    # hybrids' linear mixers keep default head counts and widths the shared sizes do not name,
    # and their stock chunked scans then cost more than the rest of a sweep's architecture:
    # Bamba's Mamba-2 mixer (128 heads of width 1) as Mamba-2's 8 heads of 16, Kimi Linear's
    # delta attention (32 heads of 128) as the attention's 4 heads of 16
    "bamba": {"mamba_n_heads": 8, "mamba_d_head": 16},
    "kimi_linear": {"linear_num_heads": 4, "linear_head_dim": 16},
    # ZAYA routes each token to one expert only
    "zaya": {"num_experts_per_tok": 1},
    # the assistant (drafter) of Gemma 4 has no per-layer input embeddings
    # zamba ties its shared attention block across hybrid layers: it needs two of them
    "zamba": {
        "num_hidden_layers": 3,
        "layers_block_type": ["linear_attention", "hybrid", "hybrid"],
    },
    # DBRX clamps q/k/v with clip_qkv and has no path without it
    "dbrx": {"clip_qkv": 8.0},
    # Qwen4-Exp's sparse (indexed) attention layers
    "qwen4_exp": _QWEN4_INDEXER,
    "qwen4_exp_text": _QWEN4_INDEXER,
    # the unified Gemma 4's multimodal embedder (3840 wide, 1120 positions by default)
    "gemma4_unified": {"mm_embed_dim": 64, "mm_posemb_size": 16, "output_proj_dims": 64},
    # Gemma 3 (and ShieldGemma 2, its classifier): one 32x32 image pooled to IMAGE_TOKENS
    # tokens, placeholders in the tiny vocabulary
    "gemma3": _GEMMA3_IMAGES,
    # (its classifier reads the yes/no token ids from the config, with defaults past 128)
    "shieldgemma2": {**_GEMMA3_IMAGES, "yes_token_index": 8, "no_token_index": 9},
    # image placeholders of the vision-language models fed images (``IMAGE_INPUTS``);
    # PaliGemma projects to 2048 by default, LLaVA-Next tiles images on a grid of 336s
    "paligemma": {**_IMAGE_TOKEN, "projection_dim": 64},
    "llava": _IMAGE_TOKEN,
    "llava_next": {**_IMAGE_TOKEN, "image_grid_pinpoints": [[IMAGE_SIZE, IMAGE_SIZE]]},
    "idefics3": _IMAGE_TOKEN,
    "smolvlm": _IMAGE_TOKEN,
    "internvl": _IMAGE_TOKEN,
    "mistral3": _IMAGE_TOKEN,
    "qwen2_vl": _QWEN_VL,
    "qwen2_5_vl": _QWEN_VL,
    "glm4v": _GLM4V,
    "glm46v": _GLM4V,
    "glmga": _GLM4V,
    "glm_ocr": _GLM4V,
    "glm4v_moe": _GLM4V_MOE,
    # WavTokenizer (Apertus 1.5's audio codec) has no projection around its quantizer
    # and its image then audio codebook token ranges must end inside the vocabulary
    "apertus1p5": {
        "codebook_dim": 64,
        "codebook_size": 32,
        "image_token_offset": VOCAB_SIZE - 64,
        "audio_token_offset": VOCAB_SIZE - 32,
        "image_token_id": IMAGE_TOKEN_ID,
        "audio_token_id": IMAGE_TOKEN_ID + 1,
        # its VQ image tokenizer (256-wide, five stages) and WavTokenizer decoder (768 wide)
        "base_channels": 32,
        "latent_channels": 32,
        "channel_multiplier": [1, 2],
        "num_res_blocks": 1,
        "decoder_hidden_size": 64,
        "decoder_intermediate_size": 96,
        "decoder_num_layers": 2,
        "num_filters": 4,  # doubled per upsampling ratio: 64 wide at the end
    },
    # mRoPE sections must sum to half the tiny head (defaults fit a 128-wide one)
    "cosmos3_edge": {
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [2, 3, 3],
        }
    },
    # ... to half of qk_rope_head_dim (8) for HY-V4-VL's latent attention
    "hy_v4_vl": {
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [2, 1, 1],
        },
        "max_image_size": IMAGE_SIZE,  # its vision position table, as HunYuan-VL's
    },
    # GLM-5-Next's sparse (DSA) attention: as many key/value heads as query heads, no RoPE part
    # (and its linear-attention heads and vision merger, 64 x 128 and 10240 wide by default)
    "glm5_next": {
        "num_key_value_heads": 4,
        "qk_rope_head_dim": 0,
        "linear_head_dim": 16,
        "linear_num_heads": 4,
        "projection_intermediate_size": 96,
    },
    # the vision tower's output width is checked against the text model's
    "inkling2": {"text_hidden_size": 64},
    "inkling2_loop": {"text_hidden_size": 64},
    # Muse Spark's vision pyramid: one patch size, width and depth per stage (num_hidden_layers)
    # (and its experts' width)
    "muse_spark": {
        "patch_sizes": [16, 6],
        "hidden_sizes": [32, 64],
        "depths": [1, 1],
        "moe_hidden_size": 32,
    },
    # sizes typed as lists: ERNIE-VL's (text, vision) experts, Molmo 2's (height, width) and
    # its two feature layers, Florence-2's DaViT per-stage sizes (two stages of two layers);
    # ERNIE-VL's (height, width, time) mRoPE sections must sum to half the tiny head
    "ernie4_5_vl_moe": {
        "moe_intermediate_size": [32, 32],
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 500000.0,
            "mrope_section": [3, 3, 2],
        },
    },
    "molmo2": {"image_size": [IMAGE_SIZE, IMAGE_SIZE], "vision_feature_layer": [-1, -2]},
    "florence2": {
        "depths": [1, 1],
        "patch_size": [7, 3],
        "patch_stride": [4, 2],
        "patch_padding": [3, 1],
        "embed_dim": [32, 64],
        "num_heads": [2, 4],
        "num_groups": [2, 4],
    },
    # HunYuan-VL's vision position table covers (max_image_size / patch)^2 patches; its
    # (position, width, height, image) mRoPE axes, which checkpoints carry, split half the head
    "hunyuan_vl": {
        "max_image_size": IMAGE_SIZE,
        "min_image_size": IMAGE_SIZE,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [2, 2, 2, 2],
        },
    },
    "janus": _VQ_IMAGES,
    # Chameleon's VQ image tokenizer, as Janus's
    "chameleon": {**_VQ_IMAGES, "vocabulary_map": {"<image>": IMAGE_TOKEN_ID}},
    # SAM image encoders' necks and downsamplers (256 to 1024 channels by default), the last
    # width being the next tower's or the projector's input
    "deepseek_ocr2": {**_SAM_NECK, "mlp_layer_types": ["dense", "sparse"]},
    "unlimited_ocr": _SAM_NECK,
    "pp_formulanet": _SAM_NECK,
    "deepseek_vl_hybrid": _SAM_NECK,
    # its LM head asserts a decoder; axial position embeddings split the hidden size
    "reformer": {"is_decoder": True, "axial_pos_embds_dim": [32, 32], "axial_pos_shape": [3, 4]},
    # per-layer-type RoPE with no default: checkpoints carry it
    "cohere_compass_text": {
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    },
    # per-layer-type RoPE with no default, as its text model's
    "cohere_compass": {
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    },
    # fields with no default that checkpoints carry (as Chameleon's vocabulary map and
    # DeepSeek-OCR 2's per-layer MLP kinds above): Granite 4 Vision's [vision layer, text
    # layer] feature injections and its Q-Former's window sides
    "granite4_vision": {"deepstack_layer_map": [[0, 0], [1, 1]], "downsample_rate": "1/2"},
    # hybrids whose default stack, cut to two layers, has no attention layer
    "lfm3": {"layer_types": ["conv", "full_attention"]},
    "recurrent_gemma": {"block_types": ["recurrent", "attention"]},
    # rotary dims default to 64, more than the tiny head
    "codegen": {"rotary_dim": 8},
    "gptj": {"rotary_dim": 8},
    # LongCat's rotary embedding is sized by head_dim, applied to the qk_rope part
    "longcat_flash": {"head_dim": 8},
    # one audio codebook, so a [batch, seq] token batch is the decoder's input
    "musicgen": {"num_codebooks": 1},
    "musicgen_melody": {"num_codebooks": 1},
    # audio / latent towers whose widths have names of their own
    "nemo_speechlm": {
        "audio_hidden_size": 64,
        "blank_token_id": VOCAB_SIZE - 1,
        # its Nemotron-H decoder's 52-layer stack, one layer of each kind
        "layers_block_type": ["linear_attention", "moe", "full_attention"],
    },
    "granite_speech": {"hidden_dim": 64},
    "granite_speech_plus": {"hidden_dim": 64},
    # wav2vec2-style feature encoders: seven 512-channel convolutions by default (4.2M
    # parameters); len(conv_dim) must stay len(conv_kernel) == len(conv_stride) == 7. SpecAugment
    # off: its training-time time masks are drawn with numpy's global RNG (stock and kernelized
    # runs would differ) and need more frames (mask_time_length 10) than the tiny audio gives
    **{
        model_type: {"conv_dim": [32] * 7, "mask_time_prob": 0.0}
        for model_type in (
            "omniasr",
            "omniasr_ctc",
            "data2vec-audio",
            "hubert",
            "unispeech",
            "unispeech-sat",
            "wav2vec2",
            "wav2vec2-conformer",
            "wavlm",
            "speecht5",
            "speech-encoder-decoder",
        )
    },
    # Kyutai STT's audio padding token is the last row of its embedding (text vocabulary, then
    # one codebook vocabulary per codebook); each codebook's BOS is inside its vocabulary
    "kyutai_speech_to_text": {
        "num_codebooks": 2,
        "codebook_vocab_size": 32,
        "audio_bos_token_id": 31,
        "audio_pad_token_id": VOCAB_SIZE + 2 * 32,
        # its Mimi codec: depthwise upsampling (one group per channel), a narrow SEANet
        "upsample_groups": 64,
        "num_filters": 2,
    },
    # Dia's decoder cross-attends to the encoder: cross_hidden_size is the encoder's width
    "dia": {
        "cross_hidden_size": 64,
        "cross_head_dim": 16,
        "cross_num_attention_heads": 4,
        "cross_num_key_value_heads": 4,
    },
    # Fun-ASR-Nano's validator: adaptor_config.intermediate_size == text_config.hidden_size // 4
    "fun_asr_nano": {"intermediate_size": 16},
    "qwen3_asr": {"downsample_hidden_size": 32, "output_dim": 64},
    # Nemotron-H Omni's audio projector reads sizes its checkpoints add to the Parakeet config
    # (and its RADIO vision tower's position table, (max_img_size / patch)^2, its width as the
    # projector reads it, its Mamba-2 heads (heads x head_dim = expand x hidden), its audio
    # subsampler and shared experts)
    "nemotron_h_omni": {
        "audio_config.projection_hidden_size": 64,
        "audio_config.projection_bias": False,
        "max_img_size": IMAGE_SIZE,
        "vision_hidden_size": 64,
        "mamba_num_heads": 8,
        "mamba_head_dim": 16,
        "ssm_state_size": 16,
        "n_groups": 2,
        "subsampling_conv_channels": 32,
        "moe_shared_expert_intermediate_size": 32,
    },
    # the Omni thinkers' position ids read vision_start_token_id, which only the full Omni
    # config defines (checkpoints' thinker configs carry it): the full config's default
    "qwen3_omni_moe_thinker": {
        "downsample_hidden_size": 32,
        "output_dim": 64,
        "vision_start_token_id": 151652,
    },
    # (and Qwen2.5-Omni's mRoPE sections, Qwen2-VL's)
    "qwen2_5_omni_thinker": {
        "vision_start_token_id": 151652,
        "rope_parameters": _QWEN_VL["rope_parameters"],
    },
    "phi4_multimodal": {
        "nemo_conv_channels": 64,
        "ext_pw_out_channel": 64,
        "depthwise_separable_out_channel": 64,
        "num_blocks": 2,
    },
    # VibeVoice's acoustic and semantic tokenizers: narrow, one block per stage
    **{
        model_type: {"num_filters": 2, "depths": [1] * 7}
        for model_type in ("vibevoice_asr", "vibevoice")
    },
    # its last layers share the key/value cache of earlier ones: none shared in two layers
    "gemma3n_text": {"num_kv_shared_layers": 0},
    "gemma3n": {"num_kv_shared_layers": 0},
    "perceiver": {"d_latents": 64, "num_latents": 16, "num_self_attends_per_block": 2},
    # its default layer list is empty (checkpoints carry it): one conv layer, one attention
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    # SqueezeBERT has no projection between embedding and hidden size
    "squeezebert": {"embedding_size": 64},
    # MobileBERT's bottleneck is narrower than its hidden size
    "mobilebert": {"embedding_size": 32, "intra_bottleneck_size": 32},
}
"""Fields a model type needs on top of the shared sizes (each a validation rule of its config or
an assumption of its model), applied where its config classes take them."""

STREAMED_AUDIO_FRAMES = {"voxtral_realtime": 8}
"""Speech LMs whose audio streams alongside the text: mel frames per text token (the encoder
downsamples by that much and adds each frame to its token)."""

CHANNEL_AUDIO = frozenset({"omniasr_ctc"})
"""Speech models whose waveform input has a channel axis: ``[batch, 1, samples]``."""

EXCLUDED: dict[str, str] = {
    "gemma4_assistant": "a draft model for Gemma 4's speculative decoding: its forward needs "
    "the target model's shared key/value states, so it has no stand-alone text path",
    "gemma4_unified_assistant": "a draft model for Gemma 4 (unified) speculative decoding: its "
    "forward needs the target model's shared key/value states",
}
"""Architectures not built, with the reason (reported as ``not built``)."""

CONFIG_VARIANTS: tuple[dict[str, Any], ...] = ({}, {"num_key_value_heads": 4})
"""Overrides tried in turn until the stock model runs: some attention layouts (DeepSeek's MLA,
...) need as many key/value heads as query heads."""


@dataclass(frozen=True)
class Architecture:
    """One model class of the auto mappings."""

    model_type: str
    family: str
    class_name: str


def architectures(families: tuple[str, ...] = tuple(FAMILIES)) -> list[Architecture]:
    """Each ``model_type`` once, in mapping order, under the first of ``families`` listing it."""
    from transformers.models.auto import modeling_auto

    seen: set[str] = set()
    found = []
    for family in families:
        for model_type, class_name in getattr(modeling_auto, FAMILIES[family]).items():
            if model_type not in seen and isinstance(class_name, str):
                seen.add(model_type)
                found.append(Architecture(model_type, family, class_name))
    return found


def _init_parameters(config_class: type) -> dict[str, inspect.Parameter]:
    return dict(inspect.signature(config_class.__init__).parameters)


def _tiny_value(sizes: dict[str, Any], name: str, default: Any) -> Any:
    if name in sizes:
        value = sizes[name]
        if isinstance(value, list | dict):  # configs keep (and change) their own copy
            return type(value)(value)
        return value
    if "drop" in name and isinstance(default, float):  # dropout, pdrop, drop_path, layerdrop
        return 0.0
    return inspect.Parameter.empty


def tiny_config(
    config_class: type,
    overrides: dict[str, Any] | None = None,
    defaults: dict[str, Any] | None = None,
) -> Any:
    """The config class's defaults (``defaults`` on top: a composite's choices for one of its
    sub-configs) with every size field it has shrunk, sub-configs too."""
    params = _init_parameters(config_class)
    sizes = {**_SIZES, **(overrides or {})}
    # a composite's defaults may carry fields the class derives (Mistral 3's Pixtral head_dim)
    kwargs = {k: sizes.get(k, v) if k not in params else v for k, v in (defaults or {}).items()}
    for name, param in params.items():
        value = _tiny_value(sizes, name, param.default)
        if value is not inspect.Parameter.empty:
            kwargs[name] = value
    for key, (sub_class, sub_defaults) in _sub_configs(config_class, params).items():
        kwargs[key] = tiny_config(sub_class, overrides, sub_defaults)
    layer_types = params.get("layer_types")
    try:
        config = config_class(**kwargs)
    except Exception:
        # strict configs check layer_types against the layer count as they are built (Zamba):
        # build again with the default stack's layer kinds cut to the tiny layer count
        name = next((n for n in ("layer_types", "layers_block_type") if n in params), None)
        kinds = _tiny_layer_types(config_class, kwargs) if name is not None else None
        if kinds is None:
            raise
        config = config_class(**kwargs, **{name: kinds})
    if layer_types is not None and isinstance(getattr(config, "layer_types", None), list):
        layers = _layer_count(config)
        if layers is not None and len(config.layer_types) != layers:
            config.layer_types = config.layer_types[:layers]
        if layers is not None and HYBRID_LAYER_KINDS & set(config.layer_types):
            config.layer_types = _hybrid_layer_types(config_class, config.layer_types, layers)
    return config


def _sub_configs(config_class: type, params: dict[str, inspect.Parameter]) -> dict:
    """Each nested config (``text_config``, ``vision_config``, ...) the class takes, as its
    config class and the composite's default fields for it.

    A sub-config declared as ``AutoConfig`` is resolved like Transformers does: through the
    composite's ``sub_configs_defaults`` model type, else the class of the composite's default.
    """
    from transformers import AutoConfig, PreTrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    specs = getattr(config_class, "sub_configs_defaults", None) or {}
    found: dict[str, tuple[type, dict[str, Any]]] = {}
    for key, sub_class in (getattr(config_class, "sub_configs", None) or {}).items():
        if key not in params or not isinstance(sub_class, type):
            continue
        spec = specs.get(key)
        defaults = dict(getattr(spec, "init_kwargs", None) or {})
        if issubclass(sub_class, AutoConfig):
            model_type = defaults.pop("model_type", None) or getattr(spec, "model_type", None)
            if model_type in CONFIG_MAPPING:
                sub_class = CONFIG_MAPPING[model_type]
            else:
                sub_class = type(getattr(config_class(), key, None))
                if not issubclass(sub_class, PreTrainedConfig):
                    continue  # no default (an encoder-decoder of any two models)
        found[key] = (sub_class, defaults)
    return found


def _tiny_layer_types(config_class: type, kwargs: dict[str, Any]) -> list | None:
    """The class's default layer kinds cut to the tiny layer count (every kind kept)."""
    layers = next((kwargs[n] for n in _LAYER_COUNTS if isinstance(kwargs.get(n), int)), None)
    try:
        full = list(getattr(config_class(), "layer_types", None) or [])
    except Exception:  # no usable defaults: nothing to cut
        return None
    if layers is None or not full or {"layer_types", "layers_block_type"} & set(kwargs):
        return None
    return _hybrid_layer_types(config_class, full[:layers], layers)


HYBRID_LAYER_KINDS = frozenset({"linear_attention", "mamba", "mamba2"})
"""Layer kinds of hybrid models; a tiny hybrid keeps one attention layer too."""


def _hybrid_layer_types(config_class: type, layer_types: list, layers: int) -> list:
    """A hybrid's shrunk layer types with every kind of its default stack kept (Qwen3-Next's
    first two layers are both linear attention: its cache then has no attention layer and
    ``generate``/``forward`` fail), the last layers taking the kinds the cut dropped."""
    try:
        full = list(getattr(config_class(), "layer_types", None) or layer_types)
    except Exception:  # a config class without usable defaults: keep what the cut gave
        full = list(layer_types)
    if not set(full) - HYBRID_LAYER_KINDS:  # all linear by default (Granite-4 hybrid)
        full.append("full_attention")  # Transformers' name for an attention layer's type
    kept = list(layer_types)
    missing = [kind for kind in dict.fromkeys(full) if kind not in kept]
    if missing and len(missing) < layers:
        kept[layers - len(missing) :] = missing
    return kept


_LAYER_COUNTS = ("num_hidden_layers", "num_layers", "n_layer")


def _layer_count(config: Any) -> int | None:
    for name in _LAYER_COUNTS:
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def _config_class(model_class: type, mapped: type) -> type:
    """The config class ``model_class`` is built from: a composite's text-only head (Llama 4's,
    Qwen 3.5's ``ForCausalLM``) takes the text sub-config, not the model type's composite."""
    own = getattr(model_class, "config_class", None)
    return (
        own
        if isinstance(own, type) and own is not mapped and own.__name__ != "PretrainedConfig"
        else mapped
    )


def _complete(config: Any) -> Any:
    """Fill what a model reads but its config class does not define (DBRX's attention reads
    ``attn_config.rope_theta``, which ``DbrxAttentionConfig`` lost to ``rope_parameters``)."""
    attn_config = getattr(config, "attn_config", None)
    rope = getattr(config, "rope_parameters", None)
    if attn_config is not None and not hasattr(attn_config, "rope_theta") and rope:
        attn_config.rope_theta = rope["rope_theta"]
    return config


class NotBuilt(Exception):
    """The architecture has no tiny model here; the message says why."""


def build(
    arch: Architecture, overrides: dict[str, Any] | None = None, seed: int = 0
) -> torch.nn.Module:
    """A tiny model of ``arch`` with seeded random weights, f32, eval mode; or ``NotBuilt``.

    1-D parameters (norm weights and biases, initialised to ones or zeros) are drawn around 1,
    so a kernel that ignores or misapplies them changes the outputs; so are matrices initialised
    to zero, so an input through them (an image) reaches the outputs.
    """
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if arch.model_type in EXCLUDED:
        raise NotBuilt(EXCLUDED[arch.model_type])
    model_class = getattr(transformers, arch.class_name, None)
    if model_class is None:
        raise NotBuilt(f"transformers has no class {arch.class_name}")
    try:
        config_class = _config_class(model_class, CONFIG_MAPPING[arch.model_type])
        fields = {**ARCHITECTURE_FIELDS.get(arch.model_type, {}), **(overrides or {})}
        config = _complete(tiny_config(config_class, fields))
        for name, value in fields.items():  # read by the model, not taken by the config class
            *path, attr = name.split(".")  # "audio_config.x": a sub-config's
            owner = functools.reduce(getattr, path, config)
            if not hasattr(owner, attr):
                setattr(owner, attr, value)
        with torch.device("meta"):
            size = sum(p.numel() for p in model_class(config).parameters())
    except Exception as exc:  # a config or model that cannot be made small: say so, go on
        raise NotBuilt(f"tiny config does not build: {one_line(exc)}") from None
    if size > MAX_PARAMETERS:
        raise NotBuilt(f"tiny config still has {size:,} parameters (> {MAX_PARAMETERS:,})")
    torch.manual_seed(seed)
    try:
        model = model_class(config).float().eval()
    except Exception as exc:
        raise NotBuilt(f"model does not build: {one_line(exc)}") from None
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.normal_(1.0, 0.2)
            elif not param.any():  # a zero-initialised matrix (Gemma 3's image projection)
                param.normal_(0.0, 0.02)
    languages = getattr(config, "languages", None)
    if languages and hasattr(model, "set_default_language"):  # X-MOD's per-language adapters
        model.set_default_language(languages[0])
    return model


def batch(arch: Architecture, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Inputs for ``model``: token batches have a padded row (left for decoders, right else)."""
    generator = torch.Generator().manual_seed(1234)
    config = model.config
    images_in_text = arch.model_type in IMAGE_INPUTS
    if arch.family == "vision" and not images_in_text:
        channels = getattr(config, "num_channels", 3)
        shape = (BATCH, channels, IMAGE_SIZE, IMAGE_SIZE)
        return {"pixel_values": torch.randn(shape, generator=generator)}
    if arch.family == "speech":
        waveform = _waveform(generator)
        if arch.model_type in CHANNEL_AUDIO:
            waveform["input_values"] = waveform["input_values"][:, None]
        return waveform
    if arch.family == "speech-seq2seq":
        # encoders read a raw waveform (SpeechT5, a wav2vec2 encoder) or mel features; a
        # speech encoder-decoder takes its encoder's input
        main_input = model.main_input_name
        if main_input == "inputs":
            main_input = model.encoder.main_input_name
        if main_input == "input_values":
            inputs = _waveform(generator)
        else:
            mels = getattr(config, "num_mel_bins", 80)
            frames = 2 * getattr(config, "max_source_positions", 1500)
            inputs = {"input_features": torch.randn(BATCH, mels, frames, generator=generator)}
        inputs["decoder_input_ids"] = _tokens(generator, DECODER_LEN)
        if "decoder_attention_mask" in inspect.signature(model.forward).parameters:
            # a right-padded decoder row (the audio encoders take fixed-length features)
            mask = torch.ones(BATCH, DECODER_LEN, dtype=torch.long)
            mask[-1, DECODER_LEN - PADDING :] = 0
            inputs["decoder_attention_mask"] = mask
        return inputs
    # speech LMs listed as sequence-to-sequence (Qwen2-Audio, Voxtral) are decoders
    seq2seq = arch.family == "encoder-decoder" and getattr(config, "is_encoder_decoder", True)
    decoder = arch.family in ("decoder", "vision", "image-text") or (
        arch.family == "encoder-decoder" and not seq2seq
    )
    input_ids = _tokens(generator, SEQ_LEN)
    attention_mask = torch.ones(BATCH, SEQ_LEN, dtype=torch.long)
    pad = slice(None, PADDING) if decoder else slice(SEQ_LEN - PADDING, None)
    input_ids[-1, pad] = PAD_TOKEN_ID
    attention_mask[-1, pad] = 0
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
    if seq2seq:
        inputs["decoder_input_ids"] = _tokens(generator, DECODER_LEN)
    if arch.model_type in STREAMED_AUDIO_FRAMES:
        frames = SEQ_LEN * STREAMED_AUDIO_FRAMES[arch.model_type]
        mels = config.audio_config.num_mel_bins
        inputs["input_features"] = torch.randn(BATCH, mels, frames, generator=generator)
    if images_in_text:
        inputs.update(_images(IMAGE_INPUTS[arch.model_type], model, inputs, generator))
    return inputs


@dataclass(frozen=True)
class ImageInputs:
    """How a vision-language model takes one image per row: ``pixels(config, generator)`` gives
    the pixel arguments for ``BATCH`` images; ``token_types`` names the argument marking image
    tokens with 1 (Gemma 3's bidirectional image blocks, Qwen2-VL's mRoPE positions) or, with
    ``prefix``, marking the prefix-LM prefix (image and prompt) with 0 and the suffix with 1
    (PaliGemma)."""

    pixels: Callable[[Any, torch.Generator], dict[str, torch.Tensor]]
    token_types: str | None = None
    prefix: bool = False


def _waveform(generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Raw audio, as wav2vec2-style feature encoders read it."""
    return {"input_values": torch.randn(BATCH, AUDIO_SAMPLES, generator=generator)}


def _vision(config: Any) -> tuple[int, int]:
    """(channels, image size) of a composite's vision tower."""
    vision = config.vision_config
    size = vision.image_size
    return getattr(vision, "num_channels", 3), size[0] if isinstance(size, list | tuple) else size


def _square(config: Any, generator: torch.Generator) -> dict[str, torch.Tensor]:
    channels, size = _vision(config)
    return {"pixel_values": torch.randn(BATCH, channels, size, size, generator=generator)}


def _with_sizes(tiles: int | None) -> Callable[[Any, torch.Generator], dict[str, torch.Tensor]]:
    """Square images with their ``image_sizes`` (Pixtral), as ``tiles`` crops (LLaVA-Next's
    base image and its one grid tile) when given."""

    def pixels(config: Any, generator: torch.Generator) -> dict[str, torch.Tensor]:
        channels, size = _vision(config)
        shape = (BATCH, *(() if tiles is None else (tiles,)), channels, size, size)
        return {
            "pixel_values": torch.randn(shape, generator=generator),
            "image_sizes": torch.tensor([[size, size]] * BATCH),
        }

    return pixels


def _one_per_row(config: Any, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Idefics3 / SmolVLM: [batch, images, channels, size, size]."""
    channels, size = _vision(config)
    return {"pixel_values": torch.randn(BATCH, 1, channels, size, size, generator=generator)}


def _patches(config: Any, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Qwen2-VL: each image as flattened (temporal x patch x patch) patches and its grid."""
    vision = config.vision_config
    side = 2 * vision.spatial_merge_size  # patches per side: two merged tokens
    features = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    return {
        "pixel_values": torch.randn(BATCH * side * side, features, generator=generator),
        "image_grid_thw": torch.tensor([[1, side, side]] * BATCH),
    }


IMAGE_INPUTS: dict[str, ImageInputs] = {
    "gemma3": ImageInputs(_square, "token_type_ids"),
    "shieldgemma2": ImageInputs(_square, "token_type_ids"),
    "paligemma": ImageInputs(_square, "token_type_ids", prefix=True),
    "llava": ImageInputs(_square),
    "llava_next": ImageInputs(_with_sizes(tiles=2)),
    "idefics3": ImageInputs(_one_per_row),
    "smolvlm": ImageInputs(_one_per_row),
    "internvl": ImageInputs(_square),
    "mistral3": ImageInputs(_with_sizes(tiles=None)),
    "qwen2_vl": ImageInputs(_patches, "mm_token_type_ids"),
    "qwen2_5_vl": ImageInputs(_patches, "mm_token_type_ids"),
}
"""Vision-language models fed one image per row; the others run their text path."""

PREFIX_TEXT = 2
"""Prompt tokens after the image in a prefix-LM prefix."""


def _image_token_count(model: torch.nn.Module, pixels: dict[str, torch.Tensor]) -> int:
    """Placeholder tokens per image: the rows of the model's own image features for one row
    (ShieldGemma 2's classifier asks the Gemma 3 model it wraps)."""
    owner = model if hasattr(model, "get_image_features") else model.model
    with torch.no_grad():
        features = owner.get_image_features(**pixels)
    pooled = getattr(features, "pooler_output", features)
    if isinstance(pooled, list | tuple):
        return pooled[0].shape[0]
    return pooled.shape[1] if pooled.dim() == 3 else pooled.shape[0] // BATCH


def _images(
    layout: ImageInputs,
    model: torch.nn.Module,
    inputs: dict[str, torch.Tensor],
    generator: torch.Generator,
) -> dict[str, torch.Tensor]:
    """One image per row: as many placeholder tokens as the model makes features of an image,
    inserted after the padding (and the first token), the pixel arguments, and the token types."""
    config = model.config
    token = getattr(config, "image_token_id", None)
    token = config.image_token_index if token is None else token
    pixels = layout.pixels(config, generator)
    count = _image_token_count(model, pixels)
    input_ids = inputs["input_ids"]
    input_ids[input_ids == token] = token + 3  # no stray placeholders in the text
    start = PADDING + 1
    placeholders = torch.full((BATCH, count), token, dtype=input_ids.dtype)
    input_ids = torch.cat([input_ids[:, :start], placeholders, input_ids[:, start:]], dim=1)
    mask = inputs["attention_mask"]
    mask = torch.cat([mask[:, :start], torch.ones_like(placeholders), mask[:, start:]], dim=1)
    images = {"input_ids": input_ids, "attention_mask": mask, **pixels}
    if layout.token_types is not None:
        types = (input_ids == token).long()
        if layout.prefix:
            types = (torch.arange(input_ids.shape[1]) >= start + count + PREFIX_TEXT).long()
            types = types.expand(BATCH, -1).clone()
        images[layout.token_types] = types
    return images


def _tokens(generator: torch.Generator, length: int) -> torch.Tensor:
    return torch.randint(3, VOCAB_SIZE, (BATCH, length), generator=generator)


def real_positions(inputs: dict[str, torch.Tensor], output: torch.Tensor) -> torch.Tensor | None:
    """Mask of the output rows that are real tokens (None: every row counts)."""
    decoder = "decoder_input_ids" in inputs
    mask = inputs.get("decoder_attention_mask" if decoder else "attention_mask")
    if mask is None or output.shape[:2] != mask.shape:
        return None
    return mask.bool()


def main_output(output: Any) -> torch.Tensor:
    """The tensor a model's output is judged by: logits, else the last hidden state."""
    for name in ("logits", "last_hidden_state", "prediction_logits"):
        value = getattr(output, name, None)
        if isinstance(value, torch.Tensor):
            return value
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TypeError(f"{type(output).__name__} has no logits or hidden states")


def one_line(exc: BaseException) -> str:
    """``Type: first line of the message`` (shortened), for report cells."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__
