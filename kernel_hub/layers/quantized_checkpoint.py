"""Loading a fine-grained FP8 checkpoint on a host without a GPU, weights kept in float8.

Transformers 5.24 refuses ``FineGrainedFP8Config`` checkpoints without a GPU or XPU. This builds
the model from its config without the quantization, puts a ``QuantizedLinear`` wherever the
checkpoint stores a ``<module>.weight_scale_inv``, and loads the tensors as stored (e4m3 weights,
f32 block scales, everything else as in the file). ``kernelize`` then serves those layers with
the quantized-matmul kernel.

Supported: ``quantization_config`` with ``quant_method: fp8`` and ``weight_block_size:
[128, 128]`` (DeepSeek-V3, Qwen3-*-FP8). Other block sizes and other methods are refused with
the reason before anything is built.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from kernel_hub.errors import KernelHubError

from .quantized_linear import FP8_BLOCK, QuantizedLinear

SCALE_SUFFIX = ".weight_scale_inv"


def fp8_config(path: str | Path) -> dict[str, Any] | None:
    """The checkpoint's fine-grained FP8 ``quantization_config``, None for an unquantized one;
    a quantization this loader does not read raises, saying which."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        return None
    quantization = json.loads(config_file.read_text()).get("quantization_config")
    if quantization is None:
        return None
    method = quantization.get("quant_method")
    if method != "fp8":
        raise KernelHubError(
            f"{path}: quantization_config quant_method={method!r}; kernel-hub loads 'fp8' "
            f"(fine-grained FP8, 128x128 block scales) kept quantized"
        )
    block = list(quantization.get("weight_block_size") or ())
    if block != [FP8_BLOCK, FP8_BLOCK]:
        raise KernelHubError(
            f"{path}: fp8 weight_block_size={block}; the quantized-matmul kernel reads "
            f"[{FP8_BLOCK}, {FP8_BLOCK}] blocks"
        )
    return quantization


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise KernelHubError(f"{path}: no *.safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(file))
    return tensors


def load_fp8(model_class: Any, path: str | Path) -> Any:
    """``model_class`` (a Transformers model or auto class) built from the checkpoint at ``path``
    with its fine-grained FP8 linear layers as ``QuantizedLinear`` holding the stored e4m3
    weights and block scales; every tensor keeps the dtype it is stored in."""
    from transformers import AutoConfig

    path = Path(path)
    fp8_config(path)
    config = AutoConfig.from_pretrained(path)
    del config.quantization_config
    from_config = getattr(model_class, "from_config", None) or model_class._from_config
    model = from_config(config)
    tensors = _tensors(path)
    for key in [k for k in tensors if k.endswith(SCALE_SUFFIX)]:
        name = key.removesuffix(SCALE_SUFFIX)
        linear = model.get_submodule(name)
        weight = tensors[f"{name}.weight"]
        if not isinstance(linear, torch.nn.Linear) or weight.dtype != torch.float8_e4m3fn:
            raise KernelHubError(
                f"{path}: {key} scales {name}, which is a {type(linear).__name__} with a "
                f"{weight.dtype} weight; fp8 block scales go with float8_e4m3fn Linear weights"
            )
        layer = QuantizedLinear(
            linear.in_features, linear.out_features, linear.bias is not None, "fp8"
        )
        model.set_submodule(name, layer)
    missing, unexpected = model.load_state_dict(tensors, strict=False, assign=True)
    tied = {k for k in missing if k.endswith("lm_head.weight") and config.tie_word_embeddings}
    if set(missing) - tied or unexpected:
        raise KernelHubError(
            f"{path}: the checkpoint does not match {type(model).__name__}: missing "
            f"{sorted(set(missing) - tied)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    if tied:
        model.tie_weights()
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            for p in (module.weight, module.scale):
                p.requires_grad_(False)
    return model.eval()
