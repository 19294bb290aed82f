"""Tiny random-weight Transformers models (no downloads) for ``kernel-hub demo`` and the tests.

Importing this module is cheap (the CLI lists the names); torch and transformers are imported
when a model is built.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from kernel_hub.errors import UnknownNameError

if TYPE_CHECKING:
    import torch

VOCAB_SIZE = 128
PAD_TOKEN_ID = 0
_SHARED = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    pad_token_id=PAD_TOKEN_ID,
    bos_token_id=1,
    eos_token_id=None,
)


def _llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(intermediate_size=128, **_SHARED))


def _mixtral() -> torch.nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        intermediate_size=96, num_local_experts=4, num_experts_per_tok=2, **_SHARED
    )
    return MixtralForCausalLM(config)


def _qwen3_moe() -> torch.nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        head_dim=16,
        **_SHARED,
    )
    return Qwen3MoeForCausalLM(config)


TINY_MODELS: dict[str, Callable[[], torch.nn.Module]] = {
    "llama": _llama,
    "mixtral": _mixtral,
    "qwen3_moe": _qwen3_moe,
}
DEFAULT_MODELS = ("llama", "mixtral")


def build_tiny_model(name: str, seed: int = 0) -> torch.nn.Module:
    """A tiny model with seeded random weights, in eval mode, f32.

    1-D parameters (norm weights, initialised to ones) are drawn around 1, so a kernel that
    ignores or misapplies the weight changes the logits.
    """
    import torch

    if name not in TINY_MODELS:
        raise UnknownNameError("demo model", name, TINY_MODELS)
    torch.manual_seed(seed)
    model = TINY_MODELS[name]().eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.normal_(1.0, 0.2)
    return model
