"""``quantize_experts``: the explicit opt-in to 8-bit or MXFP4 expert weights for bf16/f32
checkpoints.

The work is the fused-moe kernel's (its Transformers integration owns the weight formats); this
resolves that kernel through the registry like ``kernelize`` does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kernel_hub.loading.resolver import get_kernel


def quantize_experts(
    model: torch.nn.Module, quantization: str, *, registry: str | Path | None = None
) -> Any:
    """Quantize every Transformers experts module of ``model`` in place ("int8": per output
    channel; "fp8": e4m3 with 128x128 block scales; "mxfp4": e2m1 with an e8m0 scale per 32
    values, GPT-OSS's checkpoint layout) and run its experts on the fused kernel.

    Returns the fused-moe kernel's ``QuantizationReport``: each weight's bytes before and after
    and its error against the weight it replaced (also logged), and the modules left alone with
    the reason. Quantized weights get no gradient (they are not trainable).
    """
    kernel = get_kernel("fused-moe", registry=registry)
    return kernel.KERNEL.integration("transformers").quantize_experts(model, quantization)
