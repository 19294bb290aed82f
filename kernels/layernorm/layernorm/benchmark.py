"""Representative shapes with FLOPs and bytes per call (bench and TPU compile checks), and the
torch paths ``kernel-hub bench`` times beside the JAX implementations.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

from kernel_hub.kernel_api import CPU_TAG, KernelCase, MeshCase

from . import api
from .api import layer_norm, layer_norm_no_affine, layer_norm_no_bias
from .layers import layer_norm_any

# (name, tokens, hidden, affine): BERT-large pretraining (batch 8 x 512 tokens, weight and bias);
# Flux's double/single blocks at 1024x1024 (4096 image + 512 text tokens, hidden 3072,
# elementwise_affine=False); ModernBERT-large (bias=False); a ragged token count.
SHAPES = (
    ("bert-large-8x512-h1024", 8 * 512, 1024, "weight+bias"),
    ("flux-4608-h3072-noaffine", 4608, 3072, "none"),
    ("modernbert-large-8x512-h1024-nobias", 8 * 512, 1024, "weight"),
    ("ragged-1000-h768", 1000, 768, "weight+bias"),
)

# (name, tokens, hidden, affine, dtype): small enough for Pallas interpret mode on a 2-core CPU.
CPU_SHAPES = (
    ("bert-tiny-8x128-h256-f32", 8 * 128, 256, "weight+bias", jnp.float32),
    ("bert-tiny-8x128-h256", 8 * 128, 256, "weight+bias", jnp.bfloat16),
    ("flux-tiny-512-h512-noaffine", 512, 512, "none", jnp.bfloat16),
)

_PARAMS = {"weight+bias": 2, "weight": 1, "none": 0}
_FUNCTIONS = {"weight+bias": layer_norm, "weight": layer_norm_no_bias, "none": layer_norm_no_affine}
"""The JAX function of each affine form: the one behind the torch op of that form."""


def case(
    name: str, tokens: int, hidden: int, affine: str = "weight+bias", dtype=jnp.bfloat16, tags=()
) -> KernelCase:
    """A forward+backward case; ``affine`` is ``weight+bias``, ``weight`` or ``none``."""
    params = _PARAMS[affine]
    itemsize = jnp.dtype(dtype).itemsize
    return KernelCase(
        name=name,
        fn=_FUNCTIONS[affine],
        args=(
            jax.ShapeDtypeStruct((tokens, hidden), dtype),
            *[jax.ShapeDtypeStruct((hidden,), dtype)] * params,
        ),
        kwargs={"eps": 1e-5},
        # mean, center, square, variance, scale per element; one more per affine parameter
        flops=(5 + params) * tokens * hidden,
        # read x, write y, read the affine parameters
        bytes_accessed=2 * tokens * hidden * itemsize + params * hidden * itemsize,
        differentiable=tuple(range(1 + params)),
        tags=tuple(tags),
    )


CASES = [
    case(name, tokens, hidden, affine, tags=(CPU_TAG,) if tokens * hidden <= 2**16 else ())
    for name, tokens, hidden, affine in SHAPES
] + [
    case(name, tokens, hidden, affine, dtype, tags=(CPU_TAG,))
    for name, tokens, hidden, affine, dtype in CPU_SHAPES
]


def _split(params: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    weight, bias = (*params, None, None)[:2]
    return weight, bias


def torch_layer_norm(x: torch.Tensor, *params: torch.Tensor, eps: float) -> torch.Tensor:
    """torch.nn.functional.layer_norm: what a torch user runs without kernel-hub."""
    weight, bias = _split(params)
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def kernel_hub_layer_norm(x: torch.Tensor, *params: torch.Tensor, eps: float) -> torch.Tensor:
    """kernel-hub's layer_norm torch ops (DLPack bridge to JAX, platform's default order)."""
    weight, bias = _split(params)
    return layer_norm_any(x, weight, bias, eps)


# Torch callables taking a case's arguments as tensors and its kwargs.
TORCH_IMPLEMENTATIONS = {"torch": torch_layer_norm, "torch-op": kernel_hub_layer_norm}


def mesh_cases() -> list[MeshCase]:
    """Rows over a (data, model) mesh with weight and bias; their gradients are all-reduced."""
    hidden = jax.ShapeDtypeStruct((1024,), jnp.bfloat16)
    return [
        MeshCase(
            "rows over data x model bf16",
            lambda x, w, b: api.layer_norm(x, w, b),
            (jax.ShapeDtypeStruct((16, 256, 1024), jnp.bfloat16), hidden, hidden),
            (("data", "model", None), (None,), (None,)),
            ("data", "model"),
            differentiable=(0, 1, 2),
            backward_collectives={"all-reduce": 1},
            # The conventions split rows over data only: x's model split is gathered.
            auto_forward_collectives={"all-gather": 1},
            auto_backward_collectives={"all-gather": 1, "all-reduce": 1},
        )
    ]
