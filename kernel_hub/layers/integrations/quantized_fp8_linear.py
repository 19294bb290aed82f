"""Transformers' own ``FP8Linear``: recognised, and left alone with the reason.

Its forward is not what the quantized-matmul kernel computes: it quantizes the activations to
float8_e4m3fn too (``activation_scheme`` "dynamic": per token in groups of 128; "static": one
``activation_scale``) before an FP8 x FP8 product in its CUDA kernels (DeepGEMM or the
``kernels`` hub's Triton finegrained-fp8 build), while the kernel keeps the activations in their
dtype (W8A16). A swap would not give its results, so kernelize refuses it. On a host without a
GPU, Transformers 5.24 never builds one (a pre-quantized FP8 checkpoint is dequantized at load,
with a warning; quantizing on the fly raises "No GPU or XPU found"), and one built by hand
cannot run its forward there (the CUDA kernel build is missing); ``kernel_hub.from_pretrained``
loads the same checkpoint with its e4m3 weights kept, as ``QuantizedLinear`` layers the kernel
serves. Measured with transformers 5.24 on this CPU.
"""

from __future__ import annotations

FP8_LINEAR = ("transformers.integrations.finegrained_fp8", "FP8Linear")
REASON = (
    "Transformers' FP8Linear quantizes its activations to float8_e4m3fn in its forward "
    "(dynamic: per token in groups of 128; static: by activation_scale) for an FP8 x FP8 CUDA "
    "product; the quantized-matmul kernel keeps activations in their dtype (W8A16), so the swap "
    "would not give its results. Load the checkpoint with kernel_hub.from_pretrained instead: "
    "its e4m3 weights stay quantized as QuantizedLinear layers the kernel serves"
)


def is_fp8_linear(cls: type) -> bool:
    """Whether ``cls`` is Transformers' ``FP8Linear`` (or a subclass), without importing it."""
    return any((c.__module__, c.__name__) == FP8_LINEAR for c in cls.__mro__)
