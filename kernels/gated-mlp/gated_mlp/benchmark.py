"""Representative shapes with FLOPs and bytes per call (bench and TPU compile checks), and the
torch paths ``kernel-hub bench`` times beside the JAX implementations."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

from kernel_hub.kernel_api import CPU_TAG, KernelCase, MeshCase

from . import api
from .api import gated_activation

gated_activation_op = api.gated_activation.torch

# (name, tokens, intermediate, activation, fused): Llama-3-8B's and Gemma-2-9B's MLPs on a 4k
# prefill, Phi-3-mini's fused gate_up.
SHAPES = (
    ("llama3-8b-swiglu-4k", 4096, 14336, "silu", False),
    ("gemma2-9b-geglu-4k", 4096, 14336, "gelu_tanh", False),
    ("phi3-mini-fused-4k", 4096, 8192, "silu", True),
)
CPU_SHAPES = (
    ("tiny-256-i1024-silu-f32", 256, 1024, "silu", False, jnp.float32),
    ("tiny-256-i1024-gelu-fused", 256, 1024, "gelu", True, jnp.bfloat16),
)


def case(name, tokens, intermediate, activation, fused, dtype=jnp.bfloat16, tags=()):
    itemsize = jnp.dtype(dtype).itemsize
    if fused:
        args = (jax.ShapeDtypeStruct((tokens, 2 * intermediate), dtype),)
    else:
        arg = jax.ShapeDtypeStruct((tokens, intermediate), dtype)
        args = (arg, arg)
    return KernelCase(
        name=name,
        fn=gated_activation,
        args=args,
        kwargs={"activation": activation},
        # activation (~6 flops) and product per element
        flops=8 * tokens * intermediate,
        bytes_accessed=3 * tokens * intermediate * itemsize,
        differentiable=tuple(range(len(args))),
        tags=tuple(tags),
        op="gated_activation",
    )


CASES = [case(*shape) for shape in SHAPES] + [
    case(*shape[:5], dtype=shape[5], tags=(CPU_TAG,)) for shape in CPU_SHAPES
]


_TORCH_ACTIVATIONS = {
    "silu": torch.nn.functional.silu,
    "gelu": torch.nn.functional.gelu,
    "gelu_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh"),
}


def torch_gated(
    x: torch.Tensor, up: torch.Tensor | None = None, activation: str = "silu"
) -> torch.Tensor:
    """What a Transformers gated MLP runs between its projections (Llama's ``act(gate) * up``;
    Phi-3's fused ``gate_up`` split in halves)."""
    gate, up = (x, up) if up is not None else x.chunk(2, dim=-1)
    return _TORCH_ACTIVATIONS[activation](gate) * up


def kernel_hub_gated(
    x: torch.Tensor, up: torch.Tensor | None = None, activation: str = "silu"
) -> torch.Tensor:
    return gated_activation_op(x, up, activation)


TORCH_IMPLEMENTATIONS = {"torch": torch_gated, "torch-op": kernel_hub_gated}


def mesh_cases() -> list[MeshCase]:
    """Rows over a (data, model) mesh, separate and fused layouts."""
    arg = jax.ShapeDtypeStruct((16, 256, 1024), jnp.bfloat16)
    return [
        MeshCase(
            "rows over data x model bf16",
            lambda g, u: api.gated_activation(g, u, "silu"),
            (arg, arg),
            (("data", "model", None), ("data", "model", None)),
            ("data", "model"),
            differentiable=(0, 1),
        ),
        MeshCase(
            "fused gate_up, rows over data x model bf16",
            lambda x: api.gated_activation(x, None, "gelu_tanh"),
            (jax.ShapeDtypeStruct((16, 256, 2048), jnp.bfloat16),),
            (("data", "model", None),),
            ("data", "model"),
            differentiable=(0,),
        ),
    ]
