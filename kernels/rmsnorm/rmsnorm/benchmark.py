"""Representative shapes with FLOPs and bytes per call (bench and TPU compile checks), and the
torch paths ``kernel-hub bench`` times beside the JAX implementations.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

from kernel_hub.kernel_api import CPU_TAG, KernelCase, MeshCase

from . import api, gated
from .api import rms_norm

rms_norm_op = api.rms_norm.torch

# (name, tokens, hidden): decode batch, prefill chunks of Llama-3-8B/70B-sized models.
SHAPES = (
    ("decode-b8-h4096", 8, 4096),
    ("prefill-8k-h4096", 8192, 4096),
    ("prefill-8k-h8192", 8192, 8192),
    ("ragged-1000-h5120", 1000, 5120),
    ("odd-hidden-4096-h1000", 4096, 1000),
)

# (name, tokens, hidden, dtype): small enough for Pallas interpret mode on a 2-core CPU.
CPU_SHAPES = (
    ("decode-b8-h4096-f32", 8, 4096, jnp.float32),
    ("chunk-512-h2048", 512, 2048, jnp.bfloat16),
    ("chunk-512-h2048-f32", 512, 2048, jnp.float32),
)


def case(name: str, tokens: int, hidden: int, dtype=jnp.bfloat16, tags=()) -> KernelCase:
    itemsize = jnp.dtype(dtype).itemsize
    return KernelCase(
        name=name,
        fn=rms_norm,
        args=(
            jax.ShapeDtypeStruct((tokens, hidden), dtype),
            jax.ShapeDtypeStruct((hidden,), dtype),
        ),
        kwargs={"eps": 1e-6},
        # square, mean, rsqrt-scale, weight-scale per element
        flops=4 * tokens * hidden,
        # read x, write y, read weight
        bytes_accessed=2 * tokens * hidden * itemsize + hidden * itemsize,
        differentiable=(0, 1),
        tags=tuple(tags),
    )


CASES = [
    case(name, tokens, hidden, tags=(CPU_TAG,) if tokens * hidden <= 2**16 else ())
    for name, tokens, hidden in SHAPES
] + [
    case(name, tokens, hidden, dtype, tags=(CPU_TAG,)) for name, tokens, hidden, dtype in CPU_SHAPES
]


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """torch.nn.functional.rms_norm: what a torch user runs without kernel-hub."""
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)


def kernel_hub_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """kernel-hub's rms_norm torch op (DLPack bridge to JAX, platform's default implementation)."""
    return rms_norm_op(x, weight, eps)


# Torch callables taking a case's arguments as tensors and its kwargs.
TORCH_IMPLEMENTATIONS = {"torch": torch_rms_norm, "torch-op": kernel_hub_rms_norm}


def mesh_cases() -> list[MeshCase]:
    """Rows over a (data, model) mesh, plain and gated (both norm/gate orders); the weight
    gradient is summed over every shard."""
    x = jax.ShapeDtypeStruct((16, 256, 1024), jnp.bfloat16)
    weight = jax.ShapeDtypeStruct((1024,), jnp.bfloat16)
    rows = ("data", "model", None)
    return [
        MeshCase(
            "rows over data x model bf16",
            api.rms_norm,
            (x, weight),
            (rows, (None,)),
            ("data", "model"),
            differentiable=(0, 1),
            backward_collectives={"all-reduce": 1},
            # The conventions split rows over data only: x's model split is gathered.
            auto_forward_collectives={"all-gather": 1},
            auto_backward_collectives={"all-gather": 1, "all-reduce": 1},
        ),
        *(
            MeshCase(
                f"gated, norm {'before' if before else 'after'} gate, rows over data x model bf16",
                lambda x, z, w, before=before: gated.gated_rms_norm(
                    x, z, w, norm_before_gate=before
                ),
                (x, x, weight),
                (rows, rows, (None,)),
                ("data", "model"),
                differentiable=(0, 1, 2),
                backward_collectives={"all-reduce": 1},
                auto_forward_collectives={"all-gather": 2},
                auto_backward_collectives={"all-gather": 2, "all-reduce": 1},
                xla_backward=True,
            )
            for before in (True, False)
        ),
    ]
