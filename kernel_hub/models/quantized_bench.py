"""Quantized linear weights for ``kernel-hub model-bench --weights``: the kernelized variant's
linear layers held the way ``quantize_linear(model, format)`` and ``kernel_hub.from_pretrained``
keep them, as ``QuantizedLinear`` layers (``kernelize`` serves them with the quantized-matmul
kernel), on the meta device: the packed weight and its scales have their stored shapes and
dtypes, and nothing is quantized (the traced program reads every parameter from its arguments).

The layers chosen are ``quantize_linear``'s: every ``torch.nn.Linear`` but the LM head (its
default ``skip``), and for int4 only those whose inputs are whole groups of 128; the others stay
bf16 and are named in the row's notes, as do weights that are no ``nn.Linear`` (fused MoE
experts: kernel-hub keeps those quantized through fused-moe, which this does not build). The
stock variant is the same model holding the dequantized weights (bf16 ``nn.Linear``), which a
quantized layer is exact against.
"""

from __future__ import annotations

from typing import Any

WEIGHTS = ("bf16", "fp8", "int8", "int4")
"""``--weights``: bf16, or the ``QuantizedLinear`` format the linear layers are held in ("int4":
symmetric, GPTQ-packed, groups of 128 inputs)."""
SKIPPED = ("lm_head",)
"""Linear layers left bf16 (``quantize_linear``'s default ``skip``)."""


def hold_quantized(model: Any, fmt: str) -> list[tuple[str, str]]:
    """Replace ``model``'s linear layers (on the meta device) by meta ``QuantizedLinear``s in
    ``fmt``; returns (module, reason) of the linear layers left bf16."""
    import torch

    from kernel_hub.layers.quantized_linear import INT4_GROUP, QuantizedLinear

    left = []
    for name, module in list(model.named_modules()):
        if type(module) is not torch.nn.Linear:
            continue
        if any(name == s or name.endswith(f".{s}") for s in SKIPPED):
            left.append((name, "the LM head (quantize_linear's default skip)"))
            continue
        if fmt == "int4" and module.in_features % INT4_GROUP:
            left.append((name, f"its {module.in_features} inputs are not whole int4 groups"))
            continue
        with torch.device("meta"):
            layer = QuantizedLinear(module.in_features, module.out_features, False, fmt)
        layer.bias = module.bias
        model.set_submodule(name, layer)
    return left


def weights_note(fmt: str, left: list[tuple[str, str]]) -> str:
    """The row's note on its linear weights."""
    if fmt == "bf16":
        return "bf16 linear weights"
    kept = sorted({name.rsplit(".", 1)[-1] for name, _ in left})
    return (
        f"nn.Linear weights held {fmt} (QuantizedLinear on the quantized-matmul kernel, as "
        f"quantize_linear or from_pretrained keep them; abstract, nothing quantized; other "
        f"weights, MoE experts included, bf16)"
        + (f"; left bf16: {', '.join(kept)}" if kept else "")
    )
