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
}


def preset(name: str) -> Preset:
    if name not in PRESETS:
        raise UnknownNameError("model preset", name, PRESETS)
    return PRESETS[name]
