"""Loading a quantized checkpoint on a host without a GPU, weights kept in their stored format.

Transformers 5.24 refuses ``FineGrainedFP8Config`` checkpoints without a GPU or XPU (and GPTQ
without its GPU packages). This builds the model from its config without the quantization, puts a
``QuantizedLinear`` wherever the checkpoint stores a quantized layer, and loads the tensors as
stored. ``kernelize`` then serves those layers with the quantized-matmul kernel.

Supported ``quantization_config``s:

- ``quant_method: fp8`` with ``weight_block_size: [128, 128]`` (DeepSeek-V3, Qwen3-*-FP8): e4m3
  ``<module>.weight`` and f32 ``<module>.weight_scale_inv``, loaded as stored.
- ``quant_method: gptq`` with ``bits: 4``, ``group_size: 128``, ``checkpoint_format`` "gptq"
  (the default) or "gptq_v2", ``sym`` true or false, ``desc_act`` true or false:
  ``<module>.qweight`` int32 [in / 8, out] is kept packed as the layer's ``weight``;
  ``<module>.scales`` [in / 128, out] becomes its f32 ``weight_scale`` (f16 -> f32, exact);
  ``<module>.qzeros`` int32 [in / 128, out / 8] (packed along ``out``, column 8c + j in bits
  4j.. of word c) is unpacked to the int32 [in / 128, out] ``weight_zeros`` the kernel
  subtracts, or dropped when every zero point is the symmetric 8. The "gptq" (v1) format stores
  each zero point minus 1 (AutoGPTQ's historical offset; "gptq_v2" stores it as is): kernel-hub
  adds the 1 back per nibble, modulo 16, as GPTQModel's v1 -> v2 conversion does (a v1 zero point
  of 0 cannot be stored: its -1 overflows into the neighbouring nibbles). ``g_idx`` [in], when
  stored, names each input row's group: input i -> group i // 128 needs nothing; act-order
  (``desc_act: true``: any order in which every group holds 128 rows) has the rows repacked
  once at load in group order and the layer's ``input_order`` set to that order, so the layer
  gathers x's columns (exact: the same products, summed in another order); a ``g_idx`` whose
  groups do not each hold 128 rows is refused.
- ``quant_method: awq`` with ``bits: 4``, ``group_size: 128``, ``zero_point: true``, GEMM
  packing (``version``/``format`` "gemm", the default): ``<module>.qweight`` int32 [in, out / 8]
  and ``qzeros`` int32 [in / 128, out / 8] pack eight values along ``out`` in AWQ's interleaved
  order (column 8c + (0, 2, 4, 6, 1, 3, 5, 7)[j] in bits 4j.. of word c), ``scales`` f16
  [in / 128, out]; ``w = (q - zero) * scale``. The 4-bit values are repacked once at load into
  GPTQ's packing along ``in`` (same bytes, still int4), zeros unpacked to ``weight_zeros``.
- ``quant_method: compressed-tensors`` (llm-compressor's W8A16 and W8A8), ``format:
  int-quantized``, every config group's ``weights`` int, 8 bits, symmetric, ``strategy:
  channel``: ``<module>.weight`` int8 [out, in] loaded as stored; ``<module>.weight_scale``
  [out, 1] becomes the f32 [out] ``weight_scale`` (exact from f16, bf16 or f32);
  ``weight_zero_point``, when stored, must be all zero, and is dropped. Every group has no
  ``input_activations`` (W8A16: "int8" layers) or every group has int, 8 bits, symmetric,
  ``strategy: token``, ``dynamic: true`` ones (W8A8: "w8a8" layers, each token's activation row
  quantized to int8 with scale ``max |row| / 127``, rounded half to even, before the product).

Anything else (other methods, bit widths, group sizes, AWQ's GEMV/Marlin/ExLlama packings) is
refused with the reason before anything is built.
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
    pack_int4,
    unpack_int4,
)

METHODS = {
    "fp8": "fine-grained FP8, 128x128 block scales",
    "gptq": "4-bit, group 128, symmetric or with zero points, act-order or not",
    "awq": "4-bit, group 128, zero points, GEMM packing",
    "compressed-tensors": "int8 weights per output channel, W8A16",
}
LAYOUTS = {
    "fp8": (".weight_scale_inv", "fp8"),
    "gptq": (".qweight", "int4"),
    "awq": (".qweight", "int4"),
    "compressed-tensors": (".weight_scale", "int8"),
}
"""method -> (the suffix of the tensor that marks a quantized layer, its QuantizedLinear format)."""
GPTQ_FORMATS = {"gptq": 1, "gptq_v2": 0}
"""GPTQ ``checkpoint_format`` -> what is added to each stored ``qzeros`` nibble (modulo 16)."""
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
"""AWQ GEMM packing: bits 4j.. of a word hold column 8c + AWQ_ORDER[j]."""
AWQ_FORMATS = ("gemm",)


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
    if method not in METHODS:
        valid = "; ".join(f"{m!r} ({what})" for m, what in METHODS.items())
        raise KernelHubError(
            f"{path}: quantization_config quant_method={method!r}; kernel-hub loads {valid} "
            f"kept quantized"
        )
    if method == "gptq":
        _check_gptq(path, quantization)
        return quantization
    if method == "awq":
        _check_awq(path, quantization)
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


def _check_int4(path: str | Path, method: str, quantization: dict[str, Any]) -> None:
    bits, group = quantization.get("bits"), quantization.get("group_size")
    if bits != 4 or group != INT4_GROUP:
        raise KernelHubError(
            f"{path}: {method} bits={bits}, group_size={group}; the int4 kernel reads bits 4, "
            f"group_size {INT4_GROUP}"
        )


def _check_gptq(path: str | Path, quantization: dict[str, Any]) -> None:
    _check_int4(path, "gptq", quantization)
    fmt = quantization.get("checkpoint_format", "gptq")
    if fmt not in GPTQ_FORMATS:
        raise KernelHubError(
            f"{path}: gptq checkpoint_format={fmt!r}; kernel-hub reads {', '.join(GPTQ_FORMATS)}"
        )


def _check_awq(path: str | Path, quantization: dict[str, Any]) -> None:
    _check_int4(path, "awq", quantization)
    fmt = str(quantization.get("version", quantization.get("format", "gemm"))).lower()
    if fmt not in AWQ_FORMATS:
        raise KernelHubError(
            f"{path}: awq version/format {fmt!r}; kernel-hub reads the GEMM packing ('gemm')"
        )
    if quantization.get("zero_point", True) is not True:
        raise KernelHubError(
            f"{path}: awq zero_point={quantization['zero_point']}; kernel-hub reads AWQ with "
            f"zero points (zero_point: true)"
        )


COMPRESSED_WEIGHTS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
COMPRESSED_ACTIVATIONS = {
    "num_bits": 8,
    "type": "int",
    "symmetric": True,
    "strategy": "token",
    "dynamic": True,
}
"""The input activations kernel-hub reads as W8A8 (dynamic per-token int8)."""
COMPRESSED_FORMAT = "int-quantized"


def compressed_layer_format(quantization: dict[str, Any]) -> str:
    """The ``QuantizedLinear`` format of a checked compressed-tensors config: "w8a8" when its
    groups quantize input activations, else "int8"."""
    groups = quantization["config_groups"].values()
    return "w8a8" if any(g.get("input_activations") is not None for g in groups) else "int8"


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
        activations = group.get("input_activations")
        if activations is None:
            continue
        wrong = {
            k: activations.get(k)
            for k, v in COMPRESSED_ACTIVATIONS.items()
            if activations.get(k) != v
        }
        if wrong:
            valid = ", ".join(f"{k}={v!r}" for k, v in COMPRESSED_ACTIVATIONS.items())
            raise KernelHubError(
                f"{path}: compressed-tensors group {name!r} has input_activations "
                f"{', '.join(f'{k}={v!r}' for k, v in wrong.items())}; kernel-hub reads none "
                f"(W8A16) or {valid} (W8A8)"
            )
    with_activations = {g.get("input_activations") is not None for g in groups.values()}
    if len(with_activations) > 1:
        raise KernelHubError(
            f"{path}: compressed-tensors groups mix W8A8 (input_activations) and W8A16 (none); "
            f"kernel-hub reads a checkpoint whose groups are all one or all the other"
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


def _unpack_columns(words: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """[rows, cols * 8] values 0..15 of int32 words packed along the last dim: bits 4j.. of
    word c hold column 8c + order[j]."""
    rows, cols = words.shape
    shifts = 4 * torch.arange(INT4_PER_WORD, dtype=torch.int32)
    nibbles = (words[:, :, None] >> shifts) & 0xF  # [rows, cols, j]
    columns = torch.empty_like(nibbles)
    columns[:, :, list(order)] = nibbles
    return columns.reshape(rows, cols * INT4_PER_WORD)


SEQUENTIAL = tuple(range(INT4_PER_WORD))


def _int4_tensors(
    path: Path, name: str, tensors: dict[str, torch.Tensor], quantization: dict[str, Any]
) -> dict[str, bool]:
    """Rewrite layer ``name``'s GPTQ or AWQ tensors in ``tensors`` as ``QuantizedLinear``'s:
    ``weight`` packed GPTQ-style [in / 8, out], f32 ``weight_scale``, int32 ``weight_zeros``
    (unless every zero point is 8) and ``input_order`` (act-order); returns the
    ``QuantizedLinear`` options (``zeros``, ``input_order``) they need."""
    awq = quantization["quant_method"] == "awq"
    qweight = tensors.pop(f"{name}.qweight")
    scales = tensors.pop(f"{name}.scales")
    qzeros = tensors.pop(f"{name}.qzeros", None)
    g_idx = tensors.pop(f"{name}.g_idx", None)
    if awq:
        inner, out = qweight.shape[0], qweight.shape[1] * INT4_PER_WORD
        layout = f"AWQ int4 is int32 [in, out / 8] (in a multiple of {INT4_GROUP})"
    else:
        inner, out = qweight.shape[0] * INT4_PER_WORD, qweight.shape[1]
        layout = f"GPTQ int4 is int32 [in / 8, out] (in a multiple of {INT4_GROUP})"
    groups = inner // INT4_GROUP
    if qweight.dtype != torch.int32 or inner % INT4_GROUP or tuple(scales.shape) != (groups, out):
        raise KernelHubError(
            f"{path}: {name}.qweight {qweight.dtype} {tuple(qweight.shape)} with scales "
            f"{tuple(scales.shape)}; {layout} with scales [in / {INT4_GROUP}, out]"
        )
    packed_zeros = (groups, out // INT4_PER_WORD)
    if qzeros is None or qzeros.dtype != torch.int32 or tuple(qzeros.shape) != packed_zeros:
        found = "missing" if qzeros is None else f"{qzeros.dtype} {tuple(qzeros.shape)}"
        raise KernelHubError(
            f"{path}: {name}.qzeros is {found}; int4 zero points are int32 {packed_zeros} "
            f"(eight per word along out)"
        )
    if awq:
        values = _unpack_columns(qweight, AWQ_ORDER)  # [in, out]
        zeros = _unpack_columns(qzeros, AWQ_ORDER)
        qweight = pack_int4(values)
    else:
        offset = GPTQ_FORMATS[quantization.get("checkpoint_format", "gptq")]
        zeros = (_unpack_columns(qzeros, SEQUENTIAL) + offset) & 0xF
    options = {"zeros": not bool((zeros == INT4_ZERO).all()), "input_order": False}
    if options["zeros"]:
        tensors[f"{name}.weight_zeros"] = zeros.to(torch.int32)
    if g_idx is not None and not torch.equal(
        g_idx.long(), torch.arange(inner, dtype=torch.int64) // INT4_GROUP
    ):
        qweight = _act_order(path, name, qweight, g_idx, tensors)
        options["input_order"] = True
    tensors[f"{name}.weight"] = qweight
    tensors[f"{name}.weight_scale"] = scales.float()
    return options


def _act_order(
    path: Path, name: str, qweight: torch.Tensor, g_idx: torch.Tensor, tensors: dict
) -> torch.Tensor:
    """Act-order: the packed rows repacked in group order (``input_order``, which the layer
    gathers x's columns in), when every group holds ``INT4_GROUP`` rows."""
    inner = qweight.shape[0] * INT4_PER_WORD
    groups = inner // INT4_GROUP
    g_idx = g_idx.long()
    counts = torch.bincount(g_idx.clamp(0, groups), minlength=groups + 1)
    if (
        g_idx.shape != (inner,)
        or g_idx.min() < 0
        or g_idx.max() >= groups
        or counts.ne(torch.tensor([INT4_GROUP] * groups + [0])).any()
    ):
        raise KernelHubError(
            f"{path}: {name}.g_idx does not put {INT4_GROUP} of the {inner} input rows in each of "
            f"the {groups} groups; the int4 kernel reads whole groups of {INT4_GROUP} rows "
            f"(act-order is read by regrouping the rows, which needs that)"
        )
    order = torch.sort(g_idx, stable=True).indices
    tensors[f"{name}.input_order"] = order
    return pack_int4(unpack_int4(qweight)[order])


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
    layer_format = compressed_layer_format(quantization) if method == "compressed-tensors" else fmt
    for key in [k for k in tensors if k.endswith(suffix)]:
        name = key.removesuffix(suffix)
        linear = model.get_submodule(name)
        options = {}
        if fmt == "int4":
            options = _int4_tensors(path, name, tensors, quantization)
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
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            layer_format,
            **options,
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
            for p in (module.weight, module.scale, module.weight_zeros):
                if p is not None:
                    p.requires_grad_(False)
    return model.eval()
