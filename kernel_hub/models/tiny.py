"""Tiny random-weight Transformers models (no downloads) for ``kernel-hub demo`` and the tests.

Tests build their models here rather than writing configs of their own: ``tiny_model(cls,
**family_fields)`` for any Transformers model class (the shared tiny sizes, ``TINY_SIZES``, plus
what the test is about: experts, a sliding window, ...), ``build_tiny_model(name)`` for the demo
models. Importing this module is cheap (the CLI lists the names); torch and transformers are
imported when a model is built.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kernel_hub.errors import UnknownNameError

if TYPE_CHECKING:
    import torch

VOCAB_SIZE = 128
PAD_TOKEN_ID = 0
TINY_SIZES = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
"""The sizes every tiny model shares: small enough for interpret-mode kernels, with grouped
query heads (4 query, 2 key/value) and more than one layer."""
_DEMO = dict(
    max_position_embeddings=128, pad_token_id=PAD_TOKEN_ID, bos_token_id=1, eos_token_id=None
)


def tiny_config(config_class: type, **fields: Any) -> Any:
    """``config_class`` at ``TINY_SIZES`` with ``fields`` on top. A size the class does not take
    as a parameter (an encoder's ``num_key_value_heads``) is left out, not stored unused."""
    takes = inspect.signature(config_class.__init__).parameters
    sizes = {name: value for name, value in TINY_SIZES.items() if name in takes}
    return config_class(**{**sizes, **fields})


def tiny_model(model_class: type, *, seed: int = 0, **fields: Any) -> torch.nn.Module:
    """A ``model_class`` (any Transformers model class) built from ``tiny_config(its
    config_class, **fields)`` with weights seeded by ``seed``, in eval mode, f32."""
    import torch

    torch.manual_seed(seed)
    return model_class(tiny_config(model_class.config_class, **fields)).eval()


def _llama(seed: int) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    return tiny_model(LlamaForCausalLM, seed=seed, **_DEMO)


def _mixtral(seed: int) -> torch.nn.Module:
    from transformers import MixtralForCausalLM

    return tiny_model(
        MixtralForCausalLM,
        seed=seed,
        intermediate_size=96,
        num_local_experts=4,
        num_experts_per_tok=2,
        **_DEMO,
    )


def _qwen3_moe(seed: int) -> torch.nn.Module:
    from transformers import Qwen3MoeForCausalLM

    return tiny_model(
        Qwen3MoeForCausalLM,
        seed=seed,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        head_dim=16,
        **_DEMO,
    )


def _seeded(seed: int, model_class: type, config: Any) -> torch.nn.Module:
    """``model_class(config)`` with weights seeded by ``seed``, in eval mode: for models whose
    sizes are not ``TINY_SIZES`` (encoder-decoders, composites)."""
    import torch

    torch.manual_seed(seed)
    return model_class(config).eval()


def _mistral(seed: int) -> torch.nn.Module:
    """A 4-token sliding window, so short padded inputs need the window mask."""
    from transformers import MistralForCausalLM

    return tiny_model(
        MistralForCausalLM, seed=seed, intermediate_size=96, sliding_window=4, **_DEMO
    )


GEMMA3_IMAGE_TOKEN = 5
GEMMA3_TOKENS_PER_IMAGE = 4


def _gemma3(seed: int) -> torch.nn.Module:
    """Gemma 3 with a SigLIP tower: 4 image tokens per 32x32 image (``GEMMA3_IMAGE_TOKEN``),
    attending to each other bidirectionally; one sliding (window 4) and one global layer."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = dict(
        TINY_SIZES,
        **_DEMO,
        intermediate_size=96,
        head_dim=16,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
    )
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=32,
        patch_size=8,
    )
    config = Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=GEMMA3_TOKENS_PER_IMAGE,
        image_token_index=GEMMA3_IMAGE_TOKEN,
        boi_token_index=6,
        eoi_token_index=7,
    )
    return _seeded(seed, Gemma3ForConditionalGeneration, config)


def _llama4_text(seed: int) -> torch.nn.Module:
    """Llama 4 text: chunked attention (chunk 4) on layer 0, global NoPE layer 1."""
    from transformers import Llama4ForCausalLM

    return tiny_model(
        Llama4ForCausalLM,
        seed=seed,
        intermediate_size=96,
        intermediate_size_mlp=96,
        head_dim=16,
        num_local_experts=2,
        num_experts_per_tok=1,
        attention_chunk_size=4,
        interleave_moe_layer_step=1,
        no_rope_layers=[1, 0],
        **_DEMO,
    )


def _whisper(seed: int) -> torch.nn.Module:
    """Whisper: bidirectional encoder over 16 mel bins x 32 frames, causal decoder with
    cross-attention to the encoder."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    config = WhisperConfig(
        vocab_size=VOCAB_SIZE,
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=96,
        decoder_ffn_dim=96,
        num_mel_bins=16,
        max_source_positions=16,
        max_target_positions=64,
        pad_token_id=PAD_TOKEN_ID,
        decoder_start_token_id=1,
        bos_token_id=1,
        eos_token_id=2,
    )
    return _seeded(seed, WhisperForConditionalGeneration, config)


def _modernbert(seed: int) -> torch.nn.Module:
    """ModernBERT: two-way local attention (|q - k| <= 2) on layers 1 and 2, global on 0."""
    from transformers import ModernBertConfig, ModernBertForMaskedLM

    config = ModernBertConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        local_attention=4,
        global_attn_every_n_layers=3,
        max_position_embeddings=128,
        pad_token_id=PAD_TOKEN_ID,
        bos_token_id=1,
        eos_token_id=2,
        cls_token_id=1,
        sep_token_id=2,
    )
    return _seeded(seed, ModernBertForMaskedLM, config)


TINY_MODELS: dict[str, Callable[[int], torch.nn.Module]] = {
    "llama": _llama,
    "mixtral": _mixtral,
    "qwen3_moe": _qwen3_moe,
    "mistral": _mistral,
    "gemma3": _gemma3,
    "llama4_text": _llama4_text,
    "whisper": _whisper,
    "modernbert": _modernbert,
}
DEFAULT_MODELS = ("llama", "mixtral")
CAUSAL_LM_MODELS = ("llama", "mixtral", "qwen3_moe", "mistral", "llama4_text")
"""Models that take ``input_ids`` alone (what ``kernel-hub demo`` feeds); the others need
pixel values, audio features or a masked-LM head."""


def build_tiny_model(name: str, seed: int = 0) -> torch.nn.Module:
    """A tiny model with seeded random weights, in eval mode, f32.

    1-D parameters (norm weights, initialised to ones) are drawn around 1, so a kernel that
    ignores or misapplies the weight changes the logits.
    """
    import torch

    if name not in TINY_MODELS:
        raise UnknownNameError("tiny model", name, TINY_MODELS)
    model = TINY_MODELS[name](seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.normal_(1.0, 0.2)
    return model
