"""Loading a quantized checkpoint on a host without a GPU, weights kept in their stored format.

Transformers 5.24 refuses ``FineGrainedFP8Config`` checkpoints without a GPU or XPU (and GPTQ
without its GPU packages). This builds the model from its config without the quantization, puts a
``QuantizedLinear`` wherever the checkpoint stores a quantized layer, and loads the tensors as
stored. ``kernelize`` then serves those layers with the quantized-matmul kernel.

Supported ``quantization_config``s:

- ``quant_method: fp8`` with ``weight_block_size: [128, 128]`` (DeepSeek-V3, Qwen3-*-FP8): e4m3
  ``<module>.weight`` and f32 ``<module>.weight_scale_inv``, loaded as stored.
- ``quant_method: gptq`` with ``bits: 4``, ``group_size: 128``, ``sym: true``, ``desc_act:
  false``, ``checkpoint_format`` "gptq" (the default) or "gptq_v2": ``<module>.qweight`` int32
  [in / 8, out] is kept packed as the layer's ``weight``; ``<module>.scales`` [in / 128, out]
  becomes its f32 ``weight_scale`` (f16 -> f32, exact); ``<module>.qzeros`` must hold the
  symmetric zero point (8; stored as 7 in the "gptq" format, which adds 1) and ``g_idx``, when
  stored, the trivial order (input i in group i // 128), and are then dropped.
- ``quant_method: compressed-tensors`` (llm-compressor's W8A16), ``format: int-quantized``, every
  config group's ``weights`` int, 8 bits, symmetric, ``strategy: channel``, no
  ``input_activations``: ``<module>.weight`` int8 [out, in] loaded as stored;
  ``<module>.weight_scale`` [out, 1] becomes the f32 [out] ``weight_scale`` (exact from f16,
  bf16 or f32); ``weight_zero_point``, when stored, must be all zero, and is dropped.

Anything else (other methods, bit widths, group sizes, asymmetric zeros, act-order, AWQ's own
packing) is refused with the reason before anything is built.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from kernel_hub.errors import KernelHubError

from .quantized_linear import (
    FORMATS,
    FP8_BLOCK,
    INT4_GROUP,
    INT4_PER_WORD,
    INT4_ZERO,
    QuantizedLinear,
)

METHODS = {
    "fp8": "fine-grained FP8, 128x128 block scales",
    "gptq": "4-bit, group 128, symmetric, no act-order",
    "compressed-tensors": "int8 weights per output channel, W8A16",
}
REFUSED_METHODS = {
    "awq": (
        "AWQ packs its 4-bit values along the output dim ([in, out / 8], interleaved order "
        "0 2 4 6 1 3 5 7) with asymmetric zeros; the int4 kernel reads GPTQ's packing along the "
        "input dim with the symmetric zero point"
    ),
}
LAYOUTS = {
    "fp8": (".weight_scale_inv", "fp8"),
    "gptq": (".qweight", "int4"),
    "compressed-tensors": (".weight_scale", "int8"),
}
"""method -> (the suffix of the tensor that marks a quantized layer, its QuantizedLinear format)."""
GPTQ_FORMATS = {"gptq": INT4_ZERO - 1, "gptq_v2": INT4_ZERO}
"""GPTQ ``checkpoint_format`` -> the symmetric zero point as stored in ``qzeros``."""


def quantization_config(path: str | Path) -> dict[str, Any] | None:
    """The checkpoint's ``quantization_config`` when kernel-hub loads it kept quantized, None
    for an unquantized one; a quantization this loader does not read raises, saying why."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        return None
    quantization = json.loads(config_file.read_text()).get("quantization_config")
    if quantization is None:
        return None
    method = quantization.get("quant_method")
    if method in REFUSED_METHODS:
        raise KernelHubError(
            f"{path}: quant_method={method!r} is not loaded: {REFUSED_METHODS[method]}"
        )
    if method not in METHODS:
        valid = "; ".join(f"{m!r} ({what})" for m, what in METHODS.items())
        raise KernelHubError(
            f"{path}: quantization_config quant_method={method!r}; kernel-hub loads {valid} "
            f"kept quantized"
        )
    if method == "gptq":
        _check_gptq(path, quantization)
        return quantization
    if method == "compressed-tensors":
        _check_compressed_tensors(path, quantization)
        return quantization
    block = list(quantization.get("weight_block_size") or ())
    if block != [FP8_BLOCK, FP8_BLOCK]:
        raise KernelHubError(
            f"{path}: fp8 weight_block_size={block}; the quantized-matmul kernel reads "
            f"[{FP8_BLOCK}, {FP8_BLOCK}] blocks"
        )
    return quantization


def _check_gptq(path: str | Path, quantization: dict[str, Any]) -> None:
    wanted = {"bits": 4, "group_size": INT4_GROUP, "sym": True, "desc_act": False}
    wrong = {k: quantization.get(k) for k, v in wanted.items() if quantization.get(k, v) != v}
    if "bits" in wrong or "group_size" in wrong:
        raise KernelHubError(
            f"{path}: gptq bits={quantization.get('bits')}, group_size="
            f"{quantization.get('group_size')}; the int4 kernel reads bits 4, group_size "
            f"{INT4_GROUP}"
        )
    if "sym" in wrong:
        raise KernelHubError(
            f"{path}: gptq sym={wrong['sym']} (asymmetric, per-group zero points); the int4 "
            f"kernel implements the symmetric layout (sym: true, zero point {INT4_ZERO})"
        )
    if "desc_act" in wrong:
        raise KernelHubError(
            f"{path}: gptq desc_act={wrong['desc_act']} (act-order: g_idx permutes the groups); "
            f"the int4 kernel reads inputs in their order (desc_act: false)"
        )
    fmt = quantization.get("checkpoint_format", "gptq")
    if fmt not in GPTQ_FORMATS:
        raise KernelHubError(
            f"{path}: gptq checkpoint_format={fmt!r}; kernel-hub reads {', '.join(GPTQ_FORMATS)}"
        )


COMPRESSED_WEIGHTS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
COMPRESSED_FORMAT = "int-quantized"


def _check_compressed_tensors(path: str | Path, quantization: dict[str, Any]) -> None:
    fmt = quantization.get("format")
    if fmt != COMPRESSED_FORMAT:
        raise KernelHubError(
            f"{path}: compressed-tensors format={fmt!r}; kernel-hub reads {COMPRESSED_FORMAT!r} "
            f"(int8 weights stored as int8)"
        )
    groups = quantization.get("config_groups") or {}
    if not groups:
        raise KernelHubError(f"{path}: compressed-tensors config has no config_groups")
    for name, group in groups.items():
        weights = group.get("weights") or {}
        wrong = {k: weights.get(k) for k, v in COMPRESSED_WEIGHTS.items() if weights.get(k) != v}
        if wrong:
            valid = ", ".join(f"{k}={v!r}" for k, v in COMPRESSED_WEIGHTS.items())
            raise KernelHubError(
                f"{path}: compressed-tensors group {name!r} has weights "
                f"{', '.join(f'{k}={v!r}' for k, v in wrong.items())}; kernel-hub reads {valid}"
            )
        if group.get("input_activations") is not None:
            raise KernelHubError(
                f"{path}: compressed-tensors group {name!r} quantizes input_activations "
                f"({group['input_activations']}); kernel-hub reads weight-only int8 (W8A16)"
            )


def _compressed_tensors(path: Path, name: str, tensors: dict[str, torch.Tensor]) -> None:
    """Rewrite layer ``name``'s compressed-tensors scale ([out, 1]) as the f32 [out]
    ``weight_scale`` ``QuantizedLinear`` holds; a stored zero point must be all zero."""
    weight, scale = tensors[f"{name}.weight"], tensors[f"{name}.weight_scale"]
    zero = tensors.pop(f"{name}.weight_zero_point", None)
    out = weight.shape[0]
    if tuple(scale.shape) not in ((out, 1), (out,)):
        raise KernelHubError(
            f"{path}: {name}.weight_scale {tuple(scale.shape)}; per-channel int8 takes "
            f"[{out}, 1] (one per output channel)"
        )
    if zero is not None and bool(zero.any()):
        raise KernelHubError(
            f"{path}: {name}.weight_zero_point is not all zero; asymmetric int8 is not implemented"
        )
    tensors[f"{name}.weight_scale"] = scale.reshape(out).float()


def _gptq_tensors(path: Path, name: str, tensors: dict[str, torch.Tensor], zero: int) -> None:
    """Rewrite layer ``name``'s GPTQ tensors in ``tensors`` as ``QuantizedLinear``'s: the packed
    ``qweight`` kept as ``weight``, ``scales`` as f32 ``weight_scale``; ``qzeros`` and ``g_idx``
    checked to be the symmetric, in-order layout, then dropped."""
    qweight = tensors.pop(f"{name}.qweight")
    scales = tensors.pop(f"{name}.scales")
    qzeros = tensors.pop(f"{name}.qzeros", None)
    g_idx = tensors.pop(f"{name}.g_idx", None)
    inner, out = qweight.shape[0] * INT4_PER_WORD, qweight.shape[1]
    groups = inner // INT4_GROUP
    if qweight.dtype != torch.int32 or inner % INT4_GROUP or tuple(scales.shape) != (groups, out):
        raise KernelHubError(
            f"{path}: {name}.qweight {qweight.dtype} {tuple(qweight.shape)} with scales "
            f"{tuple(scales.shape)}; GPTQ int4 is int32 [in / 8, out] (in a multiple of "
            f"{INT4_GROUP}) with scales [in / {INT4_GROUP}, out]"
        )
    word = sum(zero << (4 * j) for j in range(INT4_PER_WORD))
    word = word - (1 << 32) if word >= 1 << 31 else word
    if qzeros is None or not bool((qzeros == word).all()):
        raise KernelHubError(
            f"{path}: {name}.qzeros is {'missing' if qzeros is None else 'not the constant'} "
            f"symmetric zero point {zero} in every nibble; asymmetric zero points are not "
            f"implemented (the int4 kernel subtracts {INT4_ZERO})"
        )
    trivial = torch.arange(inner, dtype=torch.int64) // INT4_GROUP
    if g_idx is not None and not torch.equal(g_idx.long(), trivial):
        raise KernelHubError(
            f"{path}: {name}.g_idx is not input i -> group i // {INT4_GROUP} (act-order); the "
            f"int4 kernel reads groups in input order"
        )
    tensors[f"{name}.weight"] = qweight
    tensors[f"{name}.weight_scale"] = scales.float()


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise KernelHubError(f"{path}: no *.safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(file))
    return tensors


def load_quantized(model_class: Any, path: str | Path) -> Any:
    """``model_class`` (a Transformers model or auto class) built from the checkpoint at ``path``
    with its quantized linear layers as ``QuantizedLinear`` holding the stored weights (e4m3 with
    block scales; GPTQ int4 packed and compressed-tensors int8, scales in f32); every other
    tensor keeps its stored dtype."""
    from transformers import AutoConfig

    path = Path(path)
    quantization = quantization_config(path)
    method = quantization["quant_method"]
    config = AutoConfig.from_pretrained(path)
    del config.quantization_config
    from_config = getattr(model_class, "from_config", None) or model_class._from_config
    model = from_config(config)
    tensors = _tensors(path)
    suffix, fmt = LAYOUTS[method]
    for key in [k for k in tensors if k.endswith(suffix)]:
        name = key.removesuffix(suffix)
        linear = model.get_submodule(name)
        if fmt == "int4":
            zero = GPTQ_FORMATS[quantization.get("checkpoint_format", "gptq")]
            _gptq_tensors(path, name, tensors, zero)
        elif method == "compressed-tensors":
            _compressed_tensors(path, name, tensors)
        weight = tensors[f"{name}.weight"]
        if not isinstance(linear, torch.nn.Linear) or weight.dtype != FORMATS[fmt][0]:
            raise KernelHubError(
                f"{path}: {key} quantizes {name}, which is a {type(linear).__name__} with a "
                f"{weight.dtype} weight; {fmt} goes with {FORMATS[fmt][0]} "
                f"Linear weights"
            )
        layer = QuantizedLinear(
            linear.in_features, linear.out_features, linear.bias is not None, fmt
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
