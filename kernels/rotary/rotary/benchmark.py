"""Representative shapes with FLOPs and bytes per call (bench and TPU compile checks), and the
torch paths ``kernel-hub bench`` times beside the JAX implementations."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

from kernel_hub.kernel_api import CPU_TAG, KernelCase, MeshCase

from . import api
from .api import rotary_embedding

rotary_embedding_op = api.rotary_embedding.torch

# (name, batch, q heads, kv heads, seq, head dim, rotary dim, options): Llama-3-8B's attention on
# a 4k prefill, a partial rotary (64 of 128 features: partial_rotary_factor 0.5), Cohere's pairs.
SHAPES = (
    ("llama3-8b-4k", 1, 32, 8, 4096, 128, 128, {}),
    ("partial-half-4k", 1, 32, 32, 4096, 128, 64, {}),
    ("cohere-interleaved-4k", 1, 32, 8, 4096, 128, 128, {"interleaved": True, "upcast": True}),
)
CPU_SHAPES = (
    ("tiny-b2-s256-f32", 2, 4, 2, 256, 64, 64, {}, jnp.float32),
    ("tiny-b2-s256-bshd-bf16", 2, 4, 2, 256, 64, 32, {"unsqueeze_dim": 2}, jnp.bfloat16),
)


def case(name, batch, heads, kv_heads, seq, dim, rot, options, dtype=jnp.bfloat16, tags=()):
    itemsize = jnp.dtype(dtype).itemsize
    bshd = options.get("unsqueeze_dim", 1) == 2

    def tensor(h):
        shape = (batch, seq, h, dim) if bshd else (batch, h, seq, dim)
        return jax.ShapeDtypeStruct(shape, dtype)

    table = jax.ShapeDtypeStruct((batch, seq, rot), dtype)
    elements = batch * (heads + kv_heads) * seq * dim
    return KernelCase(
        name=name,
        fn=rotary_embedding,
        args=(tensor(heads), tensor(kv_heads), table, table),
        kwargs=dict(options),
        flops=3 * elements,  # two products and a sum per element
        bytes_accessed=2 * elements * itemsize + 2 * batch * seq * rot * itemsize,
        differentiable=(0, 1),
        tags=tuple(tags),
        op="rotary_embedding",
    )


CASES = [case(*shape) for shape in SHAPES] + [
    case(*shape[:8], dtype=shape[8], tags=(CPU_TAG,)) for shape in CPU_SHAPES
]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def torch_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    unsqueeze_dim: int = 1,
    interleaved: bool = False,
    upcast: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What Transformers' ``apply_rotary_pos_emb`` runs (Llama's; Cohere's with the options)."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    rotate = _rotate_pairs if interleaved else _rotate_half
    rot = cos.shape[-1]

    def apply(x):
        part = x[..., :rot].float() if upcast else x[..., :rot]
        y = part * cos + rotate(part) * sin
        return torch.cat((y.to(x.dtype) if upcast else y, x[..., rot:]), dim=-1)

    return apply(q), apply(k)


def kernel_hub_rotary(q, k, cos, sin, unsqueeze_dim=1, interleaved=False, upcast=False):
    return rotary_embedding_op(q, k, cos, sin, unsqueeze_dim, interleaved, upcast, upcast)


TORCH_IMPLEMENTATIONS = {"torch": torch_rotary, "torch-op": kernel_hub_rotary}


def mesh_cases() -> list[MeshCase]:
    """Batch over data and heads over model (grouped-query k), both layouts; tables shared by
    the batch, their gradient summed over the data shards. On an Auto mesh the sequence split is
    resharded to the conventions' batch split (all-to-all)."""
    table = jax.ShapeDtypeStruct((16, 512, 128), jnp.float32)
    return [
        MeshCase(
            "batch over data, heads over model bf16",
            lambda q, k, c, s: api.rotary_embedding(q, k, c, s),
            (
                jax.ShapeDtypeStruct((16, 32, 512, 128), jnp.bfloat16),
                jax.ShapeDtypeStruct((16, 8, 512, 128), jnp.bfloat16),
                table,
                table,
            ),
            (
                ("data", "model", None, None),
                ("data", "model", None, None),
                ("data", None, None),
                ("data", None, None),
            ),
            ("data", "model"),
            differentiable=(0, 1),
        ),
        MeshCase(
            "[B, S, H, D] layout, sequence over data, heads over model bf16",
            lambda q, k, c, s: api.rotary_embedding(q, k, c, s, unsqueeze_dim=2),
            (
                jax.ShapeDtypeStruct((16, 512, 32, 128), jnp.bfloat16),
                jax.ShapeDtypeStruct((16, 512, 8, 128), jnp.bfloat16),
                table,
                table,
            ),
            (
                (None, "data", "model", None),
                (None, "data", "model", None),
                (None, "data", None),
                (None, "data", None),
            ),
            ("data", "model"),
            differentiable=(0, 1),
            auto_forward_collectives={"all-to-all": 2},
            auto_backward_collectives={"all-to-all": 2},
        ),
        MeshCase(
            "shared tables, batch over data, heads over model bf16",
            lambda q, k, c, s: api.rotary_embedding(q, k, c, s),
            (
                jax.ShapeDtypeStruct((16, 32, 512, 128), jnp.bfloat16),
                jax.ShapeDtypeStruct((16, 8, 512, 128), jnp.bfloat16),
                jax.ShapeDtypeStruct((1, 512, 128), jnp.float32),
                jax.ShapeDtypeStruct((1, 512, 128), jnp.float32),
            ),
            (("data", "model", None, None), ("data", "model", None, None), (), ()),
            ("data", "model"),
            differentiable=(0, 1, 2, 3),
            backward_collectives={"all-reduce": 1},
        ),
    ]
