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


TINY_MODELS: dict[str, Callable[[int], torch.nn.Module]] = {
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
    model = TINY_MODELS[name](seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.normal_(1.0, 0.2)
    return model
