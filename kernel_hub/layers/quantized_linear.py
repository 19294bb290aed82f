"""``QuantizedLinear``: a linear layer whose weight stays in its stored 8-bit format, and
``quantize_linear``, the explicit opt-in that quantizes a model's ``nn.Linear`` layers.

The module's own ``forward`` is the stock computation: the whole weight dequantized in torch
(``weight * scale`` in f32, rounded once to the activation dtype, Transformers' order), then
``F.linear``. Its class is marked ``kernel_layer_name = "QuantizedLinear"``, so ``kernelize``
replaces that forward with the quantized-matmul kernel's layer, which reads the weight quantized.

Formats (``kernel_api.weight_formats``): "fp8" (float8_e4m3fn [out, in] with ``weight_scale_inv``
f32 [ceil(out / 128), ceil(in / 128)], fine-grained FP8 checkpoints' names and layout), "int8"
(int8 [out, in] with ``weight_scale`` f32 [out], symmetric per output channel) and "int4"
(GPTQ's packing, from GPTQ and AWQ checkpoints or ``quantize_linear``: ``weight`` int32
[in / 8, out], eight 4-bit values per word along ``in``, with ``weight_scale`` f32
[in / 128, out], one per group of 128 inputs; symmetric with zero point 8, or, built with
``zeros=True``, ``weight_zeros`` int32 [in / 128, out], the zero point subtracted per group and
output column; built with ``input_order=True``, the ``input_order`` buffer int64 [in] says which
input column each stored row multiplies: ``x[..., input_order]`` is the activation the stored
rows take, the form GPTQ's act-order checkpoints are loaded in). "w8a8" holds what "int8" holds
and also quantizes its input activations, each token's row to int8 with its own scale (largest
magnitude at 127, rounded half to even), before the product: opt-in and lossy
(``quantize_linear(model, "w8a8")``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernel_hub.errors import KernelHubError

log = logging.getLogger(__name__)

FP8_BLOCK = 128
INT4_GROUP = 128
INT4_PER_WORD = 8
INT4_ZERO = 8
FORMATS = {
    "fp8": (torch.float8_e4m3fn, "weight_scale_inv"),
    "int8": (torch.int8, "weight_scale"),
    "int4": (torch.int32, "weight_scale"),
    "w8a8": (torch.int8, "weight_scale"),
}
"""format -> (stored weight dtype, the scale's attribute and checkpoint name)."""
QUANTIZE_FORMATS = ("fp8", "int8", "w8a8", "int4", "int4-asym")
"""The formats ``quantize_linear`` writes: "int4" is symmetric (zero point 8), "int4-asym" has a
zero point per group and output column; both in groups of 128 inputs."""


def scale_shape(fmt: str, out: int, inner: int) -> tuple[int, ...]:
    if fmt in ("int8", "w8a8"):
        return (out,)
    if fmt == "int4":
        return (inner // INT4_GROUP, out)
    return (-(-out // FP8_BLOCK), -(-inner // FP8_BLOCK))


def weight_shape(fmt: str, out: int, inner: int) -> tuple[int, int]:
    """The stored weight's shape: [out, in], int4 packed [in / 8, out]."""
    return (inner // INT4_PER_WORD, out) if fmt == "int4" else (out, inner)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The [in, out] values 0..15 of GPTQ-packed [in / 8, out] int32 words."""
    rows, out = packed.shape
    shifts = 4 * torch.arange(INT4_PER_WORD, device=packed.device, dtype=torch.int32)
    return ((packed[:, None, :] >> shifts[None, :, None]) & 0xF).reshape(rows * INT4_PER_WORD, out)


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """GPTQ's packing of [in, out] values 0..15: int32 [in / 8, out], input row 8r + j in bits
    4j..4j+3 of word r (``unpack_int4``'s inverse)."""
    inner, out = values.shape
    shifts = 4 * torch.arange(INT4_PER_WORD, device=values.device, dtype=torch.int64)
    nibbles = values.to(torch.int64).reshape(inner // INT4_PER_WORD, INT4_PER_WORD, out)
    words = (nibbles << shifts[None, :, None]).sum(1)
    return (words - (words >= 2**31).long() * 2**32).to(torch.int32)  # the same 32 bits


def dequantize(
    weight: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype,
    zeros: torch.Tensor | None = None,
) -> torch.Tensor:
    """``weight * scale`` [out, in] in f32 (f64 for f64), rounded once to ``dtype``; int4:
    ``(value - zero) * scale`` of its group (zero: ``zeros``' entry, or 8)."""
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    if weight.dtype == torch.int32:
        zero = INT4_ZERO if zeros is None else zeros.repeat_interleave(INT4_GROUP, 0)
        values = (unpack_int4(weight) - zero).to(acc)
        return (values * scale.to(acc).repeat_interleave(INT4_GROUP, 0)).T.to(dtype)
    out, inner = weight.shape
    if weight.dtype == torch.int8:
        full = scale.to(acc)[:, None]
    else:
        full = scale.to(acc).repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)
        full = full[:out, :inner]
    return (weight.to(acc) * full).to(dtype)


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """W8A8's activations as the layer sees them: each row of ``x`` (last dim) quantized to int8
    with scale ``max |row| / 127`` (1 for an all-zero row), rounded half to even, and multiplied
    back, in f32, rounded once to x's dtype."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    return ((xf / scale).round().clamp(-127, 127) * scale).to(x.dtype)


class QuantizedLinear(torch.nn.Module):
    """A Linear with a frozen 8-bit weight and its scale (see the module docstring)."""

    kernel_layer_name = "QuantizedLinear"

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        fmt: str,
        *,
        zeros: bool = False,
        input_order: bool = False,
    ) -> None:
        super().__init__()
        if fmt not in FORMATS:
            raise KernelHubError(f"QuantizedLinear: format {fmt!r}; valid: {', '.join(FORMATS)}")
        if (zeros or input_order) and fmt != "int4":
            raise KernelHubError(
                f"QuantizedLinear: zeros / input_order are int4's (group zero points, act-order); "
                f"format {fmt!r} has neither"
            )
        dtype, scale_name = FORMATS[fmt]
        self.in_features, self.out_features, self.format = in_features, out_features, fmt
        self.weight = torch.nn.Parameter(
            torch.zeros(weight_shape(fmt, out_features, in_features), dtype=dtype),
            requires_grad=False,
        )
        shape = scale_shape(fmt, out_features, in_features)
        self.register_parameter(
            scale_name, torch.nn.Parameter(torch.ones(shape), requires_grad=False)
        )
        self.register_parameter(
            "bias", torch.nn.Parameter(torch.zeros(out_features)) if bias else None
        )
        zero_points = torch.full(shape, INT4_ZERO, dtype=torch.int32)
        self.register_parameter(
            "weight_zeros",
            torch.nn.Parameter(zero_points, requires_grad=False) if zeros else None,
        )
        order = torch.arange(in_features) if input_order else None
        self.register_buffer("input_order", order)

    @property
    def scale(self) -> torch.Tensor:
        return getattr(self, FORMATS[self.format][1])

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight = dequantize(self.weight, self.scale, input.dtype, self.weight_zeros)
        if self.input_order is not None:
            input = input.index_select(-1, self.input_order)
        if self.format == "w8a8":
            input = quantize_rows(input)
        return torch.nn.functional.linear(input, weight, self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, format={self.format}"
        )


def quantize_int4(
    weight: torch.Tensor, symmetric: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(GPTQ-packed weight, scale [in / 128, out], zeros or None) of a float [out, in] weight in
    groups of 128 inputs per output column: symmetric, each group's largest magnitude at 7 steps
    of ``scale = amax / 7`` (values -8..7 stored + 8); asymmetric, ``scale = (max - min) / 15``
    and ``zero = round(-min / scale)`` in 0..15, ``q = round(w / scale) + zero`` in 0..15."""
    w = weight.detach().float().T  # [in, out]
    inner, out = w.shape
    groups = w.reshape(inner // INT4_GROUP, INT4_GROUP, out)
    if symmetric:
        scale = groups.abs().amax(1).clamp_min(1e-12) / 7
        zero = torch.full_like(scale, INT4_ZERO)
    else:
        lo, hi = groups.amin(1).clamp(max=0), groups.amax(1).clamp(min=0)
        scale = ((hi - lo) / 15).clamp_min(1e-12)
        zero = (-lo / scale).round().clamp(0, 15)
    q = (groups / scale[:, None]).round() + zero[:, None]
    packed = pack_int4(q.clamp(0, 15).reshape(inner, out).to(torch.int32))
    return packed, scale, None if symmetric else zero.to(torch.int32)


def quantize_weight(weight: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(quantized weight, scale) of a float [out, in] weight: fp8 scales each 128 x 128 block's
    largest magnitude to e4m3's 448, int8 each output channel's to 127."""
    w = weight.detach().float()
    out, inner = w.shape
    if fmt in ("int8", "w8a8"):
        scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127
        return (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale
    rows, cols = scale_shape(fmt, out, inner)
    padded = torch.zeros(rows * FP8_BLOCK, cols * FP8_BLOCK)
    padded[:out, :inner] = w
    blocks = padded.reshape(rows, FP8_BLOCK, cols, FP8_BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12) / torch.finfo(torch.float8_e4m3fn).max
    q = (blocks / scale[:, None, :, None]).reshape(rows * FP8_BLOCK, cols * FP8_BLOCK)
    return q[:out, :inner].to(torch.float8_e4m3fn), scale


@dataclass(frozen=True)
class QuantizedLayer:
    """One layer ``quantize_linear`` quantized: bytes of its weight before and after, and the
    dequantized weight's error against the weight it replaced (max abs, and relative to the
    weight's largest magnitude)."""

    module: str
    bytes_before: int
    bytes_after: int
    max_abs_error: float
    max_rel_error: float


@dataclass(frozen=True)
class LinearQuantizationReport:
    format: str
    layers: tuple[QuantizedLayer, ...]
    left_alone: tuple[tuple[str, str], ...]
    """(module, reason) of the ``nn.Linear`` layers not quantized."""


def quantize_linear(
    model: torch.nn.Module, format: str, *, skip: Sequence[str] = ("lm_head",)
) -> LinearQuantizationReport:
    """Replace every ``torch.nn.Linear`` of ``model`` (but those whose name ends with an entry
    of ``skip``) by a ``QuantizedLinear`` in ``format`` ("fp8", "int8", "w8a8": int8 weights
    and dynamic per-token int8 activations, "int4": symmetric 4-bit in groups of 128 inputs,
    "int4-asym": the same with a zero point per group), in place; ``kernelize`` then runs them
    on the quantized-matmul kernel. A lossy, explicit choice: the report gives each layer's measured
    weight error (also logged) and its bytes before and after (w8a8's activation error depends
    on the inputs: docs/quantized-linear.md gives it measured)."""
    if format not in QUANTIZE_FORMATS:
        raise KernelHubError(
            f"quantize_linear: format {format!r}; valid: {', '.join(QUANTIZE_FORMATS)}"
        )
    int4 = format.startswith("int4")
    done, left = [], []
    for name, module in list(model.named_modules()):
        if type(module) is not torch.nn.Linear:
            continue
        if any(name == s or name.endswith(f".{s}") for s in skip):
            left.append((name, "skipped (skip=)"))
            continue
        if module.weight.device.type == "meta":
            left.append((name, "its weight is on the meta device"))
            continue
        if int4 and module.in_features % INT4_GROUP:
            left.append((name, f"its {module.in_features} inputs are not whole int4 groups of 128"))
            continue
        weight = module.weight.detach()
        zeros = None
        if int4:
            q, scale, zeros = quantize_int4(weight, format == "int4")
        else:
            q, scale = quantize_weight(weight, format)
        fmt = "int4" if int4 else format
        layer = QuantizedLinear(
            module.in_features, module.out_features, False, fmt, zeros=zeros is not None
        )
        layer.weight.data = q.to(weight.device)
        layer.scale.data = scale.to(weight.device)
        if zeros is not None:
            layer.weight_zeros.data = zeros.to(weight.device)
        layer.bias = module.bias
        dequantized = dequantize(q, scale, torch.float64, zeros)
        error = (dequantized - weight.double()).abs().max().item()
        top = weight.double().abs().max().item() or 1.0
        done.append(
            QuantizedLayer(
                name,
                weight.numel() * weight.element_size(),
                sum(t.numel() * t.element_size() for t in (q, scale, zeros) if t is not None),
                error,
                error / top,
            )
        )
        model.set_submodule(name, layer)
    worst = max((layer.max_rel_error for layer in done), default=0.0)
    log.info("quantize_linear(%s): %d layers, largest weight error %.3g", format, len(done), worst)
    return LinearQuantizationReport(format, tuple(done), tuple(left))
