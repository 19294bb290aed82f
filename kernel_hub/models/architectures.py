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

import inspect
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
    # hybrids (Bamba, Jamba): one attention layer of the two, so the cache has one
    "attn_layer_indices": [1],
    "attn_layer_period": 2,
    "attn_layer_offset": 1,
    **dict.fromkeys(
        ("router_jitter_noise", "layerdrop", "encoder_layerdrop", "decoder_layerdrop"), 0.0
    ),
}
"""Config field -> tiny value, applied where the config class has that field."""

MODEL_TYPE_SIZES: dict[str, dict[str, Any]] = {
    # Mamba-2 checks hidden_size * expand (2) == num_heads * head_dim (16)
    "mamba2": {"num_heads": 8},
    # Zamba's layer list does not follow num_hidden_layers: a Mamba layer and hybrid layers (Zamba
    # ties the shared attention of its hybrid layers to the first one's: it needs two)
    "zamba": {
        "num_hidden_layers": 3,
        "layers_block_type": ["linear_attention", "hybrid", "hybrid"],
    },
    "zamba2": {"layers_block_type": ["linear_attention", "hybrid"]},
    # Qwen4-Exp's attention layers always build the QSA indexer, whose sizes default to None
    "qwen4_exp_text": {
        "indexer_n_heads": 2,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 16,
        "indexer_budget": 8,
        "indexer_compress_ratio": 4,
    },
}
"""Per model type: sizes a config checks against each other, where the shared ones disagree."""

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
        return list(value) if isinstance(value, list) else value  # configs keep their own list
    if "drop" in name and isinstance(default, float):  # dropout, pdrop, drop_path, layerdrop
        return 0.0
    return inspect.Parameter.empty


def tiny_config(config_class: type, overrides: dict[str, Any] | None = None) -> Any:
    """The config class's defaults with every size field it has shrunk (sub-configs too)."""
    params = _init_parameters(config_class)
    own = MODEL_TYPE_SIZES.get(getattr(config_class, "model_type", ""), {})
    sizes = {**_SIZES, **own, **(overrides or {})}
    kwargs: dict[str, Any] = {}
    for name, param in params.items():
        value = _tiny_value(sizes, name, param.default)
        if value is not inspect.Parameter.empty:
            kwargs[name] = value
    for key, sub_class in (getattr(config_class, "sub_configs", None) or {}).items():
        if key in params and isinstance(sub_class, type):
            kwargs[key] = tiny_config(sub_class, overrides)
    layer_types = params.get("layer_types")
    config = config_class(**kwargs)
    if layer_types is not None and isinstance(getattr(config, "layer_types", None), list):
        layers = _layer_count(config)
        if layers is not None and len(config.layer_types) != layers:
            config.layer_types = config.layer_types[:layers]
        if layers is not None and HYBRID_LAYER_KINDS & set(config.layer_types):
            config.layer_types = _hybrid_layer_types(config_class, config.layer_types, layers)
    return config


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


def _layer_count(config: Any) -> int | None:
    for name in ("num_hidden_layers", "num_layers", "n_layer"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


class NotBuilt(Exception):
    """The architecture has no tiny model here; the message says why."""


def build(
    arch: Architecture, overrides: dict[str, Any] | None = None, seed: int = 0
) -> torch.nn.Module:
    """A tiny model of ``arch`` with seeded random weights, f32, eval mode; or ``NotBuilt``.

    1-D parameters (norm weights and biases, initialised to ones or zeros) are drawn around 1,
    so a kernel that ignores or misapplies them changes the outputs.
    """
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_class = getattr(transformers, arch.class_name, None)
    if model_class is None:
        raise NotBuilt(f"transformers has no class {arch.class_name}")
    try:
        config = tiny_config(CONFIG_MAPPING[arch.model_type], overrides)
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
    return model


def batch(arch: Architecture, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Inputs for ``model``: token batches have a padded row (left for decoders, right else)."""
    generator = torch.Generator().manual_seed(1234)
    config = model.config
    if arch.family == "vision":
        channels = getattr(config, "num_channels", 3)
        shape = (BATCH, channels, IMAGE_SIZE, IMAGE_SIZE)
        return {"pixel_values": torch.randn(shape, generator=generator)}
    if arch.family == "speech":
        return {"input_values": torch.randn(BATCH, AUDIO_SAMPLES, generator=generator)}
    if arch.family == "speech-seq2seq":
        mels = getattr(config, "num_mel_bins", 80)
        frames = 2 * getattr(config, "max_source_positions", 1500)
        return {
            "input_features": torch.randn(BATCH, mels, frames, generator=generator),
            "decoder_input_ids": _tokens(generator, DECODER_LEN),
        }
    input_ids = _tokens(generator, SEQ_LEN)
    attention_mask = torch.ones(BATCH, SEQ_LEN, dtype=torch.long)
    pad = slice(None, PADDING) if arch.family == "decoder" else slice(SEQ_LEN - PADDING, None)
    input_ids[-1, pad] = PAD_TOKEN_ID
    attention_mask[-1, pad] = 0
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
    if arch.family == "encoder-decoder":
        inputs["decoder_input_ids"] = _tokens(generator, DECODER_LEN)
    return inputs


def _tokens(generator: torch.Generator, length: int) -> torch.Tensor:
    return torch.randint(3, VOCAB_SIZE, (BATCH, length), generator=generator)


def real_positions(inputs: dict[str, torch.Tensor], output: torch.Tensor) -> torch.Tensor | None:
    """Mask of the output rows that are real tokens (None: every row counts)."""
    mask = inputs.get("attention_mask")
    if mask is None or "decoder_input_ids" in inputs or output.shape[:2] != mask.shape:
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
