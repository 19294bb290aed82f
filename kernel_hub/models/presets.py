"""Published models' Transformers configs, written as data (nothing is downloaded).

Each preset is a model type and the fields of its ``config.json`` that set sizes; fields left out
take Transformers' defaults for that model type. ``kernel-hub model-bench`` builds them at real
width with a few decoder layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kernel_hub.errors import UnknownNameError


@dataclass(frozen=True)
class Preset:
    model_type: str
    config: dict[str, Any] = field(default_factory=dict)
    source: str = ""
    """The Hub repository whose config.json the fields come from."""
    library: str = "transformers"
    """``transformers`` (``model_type`` a Transformers model type) or ``diffusers``
    (``model_type`` a Diffusers model class)."""


PRESETS: dict[str, Preset] = {
    "llama-3-8b": Preset(
        "llama",
        {
            "vocab_size": 128256,
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-5,
            "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
            "tie_word_embeddings": False,
        },
        "meta-llama/Meta-Llama-3-8B",
    ),
    "llama-3-70b": Preset(
        "llama",
        {
            "vocab_size": 128256,
            "hidden_size": 8192,
            "intermediate_size": 28672,
            "num_hidden_layers": 80,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-5,
            "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
            "tie_word_embeddings": False,
        },
        "meta-llama/Meta-Llama-3-70B (140 GB of bf16 weights: run it with --topology)",
    ),
    "qwen3-8b": Preset(
        "qwen3",
        {
            "vocab_size": 151936,
            "hidden_size": 4096,
            "intermediate_size": 12288,
            "num_hidden_layers": 36,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "max_position_embeddings": 40960,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
            "tie_word_embeddings": False,
        },
        "Qwen/Qwen3-8B",
    ),
    "qwen3-30b-a3b": Preset(
        "qwen3_moe",
        {
            "vocab_size": 151936,
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "moe_intermediate_size": 768,
            "num_hidden_layers": 48,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "norm_topk_prob": True,
            "max_position_embeddings": 40960,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
            "tie_word_embeddings": False,
        },
        "Qwen/Qwen3-30B-A3B",
    ),
    "gemma-3-12b": Preset(
        "gemma3_text",
        {
            "vocab_size": 262208,
            "hidden_size": 3840,
            "intermediate_size": 15360,
            "num_hidden_layers": 48,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 256,
            "query_pre_attn_scalar": 256,
            "sliding_window": 1024,
            "sliding_window_pattern": 6,
            "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
            "final_logit_softcapping": None,
            "attn_logit_softcapping": None,
            "tie_word_embeddings": True,
        },
        "google/gemma-3-12b-pt (text_config)",
    ),
    "gpt-oss-20b": Preset(
        "gpt_oss",
        {
            "vocab_size": 201088,
            "hidden_size": 2880,
            "intermediate_size": 2880,
            "num_hidden_layers": 24,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "num_local_experts": 32,
            "num_experts_per_tok": 4,
            "sliding_window": 128,
            "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False,
        },
        "openai/gpt-oss-20b (weights bf16 here; the checkpoint's experts are MXFP4)",
    ),
    "qwen3-next-80b-a3b": Preset(
        "qwen3_next",
        {
            "vocab_size": 151936,
            "hidden_size": 2048,
            "intermediate_size": 5120,
            "num_hidden_layers": 48,
            "num_attention_heads": 16,
            "num_key_value_heads": 2,
            "head_dim": 256,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 32,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4,
            "full_attention_interval": 4,
            "num_experts": 512,
            "num_experts_per_tok": 10,
            "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512,
            "decoder_sparse_step": 1,
            "norm_topk_prob": True,
            "max_position_embeddings": 262144,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000000.0,
                "partial_rotary_factor": 0.25,
            },
            "tie_word_embeddings": False,
        },
        "Qwen/Qwen3-Next-80B-A3B-Instruct",
    ),
    "flux-1-dev": Preset(
        "FluxTransformer2DModel",
        {
            "patch_size": 1,
            "in_channels": 64,
            "num_layers": 19,
            "num_single_layers": 38,
            "attention_head_dim": 128,
            "num_attention_heads": 24,
            "joint_attention_dim": 4096,
            "pooled_projection_dim": 768,
            "guidance_embeds": True,
            "axes_dims_rope": (16, 56, 56),
        },
        "black-forest-labs/FLUX.1-dev (transformer/config.json)",
        library="diffusers",
    ),
}


def preset(name: str) -> Preset:
    if name not in PRESETS:
        raise UnknownNameError("model preset", name, PRESETS)
    return PRESETS[name]
