"""Representative gmm calls with FLOPs and bytes per call (bench and TPU compile checks), and the
torch paths ``kernel-hub bench`` times beside the JAX implementations.

Each MoE layer does two grouped matmuls on Transformers' weight layout (``transpose_rhs``):
gate/up ([m, H] x [E, 2I, H]) and down ([m, I] x [E, H, I]), with m = tokens * top_k rows.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import torch

from kernel_hub.kernel_api import CPU_TAG, KernelCase, MeshCase, weight_formats

from . import api, expert_parallel
from .api import gmm, gmm_quantized

gmm_op = api.gmm.torch


class MoEShape(NamedTuple):
    name: str
    experts: int
    hidden: int
    intermediate: int
    top_k: int


MIXTRAL = MoEShape("mixtral-8x7b", experts=8, hidden=4096, intermediate=14336, top_k=2)
# Fine-grained experts, DeepSeekMoE-16B sized.
FINE_GRAINED = MoEShape("fine-grained-e64", experts=64, hidden=2048, intermediate=1408, top_k=6)
# Decode at top-k 8 with many small experts: OLMoE-1B-7B and Qwen3-30B-A3B sized.
OLMOE = MoEShape("olmoe-e64-top8", experts=64, hidden=2048, intermediate=1024, top_k=8)
QWEN3_MOE = MoEShape("qwen3-moe-e128-top8", experts=128, hidden=2048, intermediate=768, top_k=8)
# Small enough for Pallas interpret mode on a 2-core CPU.
SMALL = MoEShape("small-e8", experts=8, hidden=256, intermediate=512, top_k=2)

# (phase, tokens): the smallest and a large decode batch, one prefill chunk.
TOKENS = (("decode", 1), ("decode", 256), ("prefill", 8192))
# Decode batches of a serving step (continuous batching), forward only.
DECODE_TOKENS = (1, 16, 64, 256)


def routed_group_sizes(rng: np.random.Generator, tokens: int, model: MoEShape) -> np.ndarray:
    """Rows per expert when each token picks ``top_k`` distinct experts uniformly at random."""
    picks = np.argsort(rng.random((tokens, model.experts)), axis=1)[:, : model.top_k]
    return np.bincount(picks.reshape(-1), minlength=model.experts).astype(np.int32)


def _projection_dims(model: MoEShape, projection: str) -> tuple[int, int]:
    """(k, n) of a projection's gmm."""
    if projection == "gate_up":
        return model.hidden, 2 * model.intermediate
    return model.intermediate, model.hidden


def case(
    model: MoEShape,
    projection: str,
    phase: str,
    tokens: int,
    dtype=jnp.bfloat16,
    tags: tuple[str, ...] = (),
    backward: bool = True,
) -> KernelCase:
    """One gmm of ``model``'s ``projection`` ("gate_up" or "down") for ``tokens`` tokens;
    ``backward=False`` for serving shapes (no gradient is compiled or timed)."""
    rows = tokens * model.top_k
    k, n = _projection_dims(model, projection)
    itemsize = jnp.dtype(dtype).itemsize
    # Only experts that receive rows have their weights read: at most min(E, rows) of them.
    experts_read = min(model.experts, rows)

    def make_args(rng: np.random.Generator):
        lhs = rng.standard_normal((rows, k), dtype=np.float32).astype(dtype)
        rhs = rng.standard_normal((model.experts, n, k), dtype=np.float32) / np.sqrt(k)
        return lhs, rhs.astype(dtype), routed_group_sizes(rng, tokens, model)

    return KernelCase(
        name=f"{model.name}-{projection}-{phase}{tokens}",
        fn=gmm,
        args=(
            jax.ShapeDtypeStruct((rows, k), dtype),
            jax.ShapeDtypeStruct((model.experts, n, k), dtype),
            jax.ShapeDtypeStruct((model.experts,), jnp.int32),
        ),
        kwargs={"transpose_rhs": True},
        flops=2 * rows * k * n,
        bytes_accessed=(rows * k + experts_read * k * n + rows * n) * itemsize,
        differentiable=(0, 1) if backward else (),
        tags=(phase, model.name, *tags),
        make_args=make_args,
    )


def quantized_case(
    model: MoEShape, projection: str, phase: str, tokens: int, fmt: str, dtype=jnp.bfloat16
) -> KernelCase:
    """One ``gmm_quantized`` of ``model``'s ``projection`` with ``fmt`` ("int8" or "fp8")
    weights, forward and the activations' gradient."""
    rows = tokens * model.top_k
    k, n = _projection_dims(model, projection)
    weight_shape = (model.experts, n, k)
    scale_shape = weight_formats.scale_shape(fmt, weight_shape)
    weight_dtype = weight_formats.WEIGHT_DTYPES[fmt]
    experts_read = min(model.experts, rows)
    scale_bytes = 4 * int(np.prod(scale_shape[1:]))

    def make_args(rng: np.random.Generator):
        lhs = rng.standard_normal((rows, k), dtype=np.float32).astype(dtype)
        w = rng.standard_normal(weight_shape, dtype=np.float32)
        q = np.clip(np.round(w * 32), -127, 127) if fmt == "int8" else w
        scale = np.full(scale_shape, 1 / 32 / np.sqrt(k), np.float32)
        return (
            lhs,
            jnp.asarray(q).astype(weight_dtype),
            scale,
            routed_group_sizes(rng, tokens, model),
        )

    return KernelCase(
        name=f"{model.name}-{projection}-{fmt}-{phase}{tokens}",
        fn=gmm_quantized,
        args=(
            jax.ShapeDtypeStruct((rows, k), dtype),
            jax.ShapeDtypeStruct(weight_shape, weight_dtype),
            jax.ShapeDtypeStruct(scale_shape, jnp.float32),
            jax.ShapeDtypeStruct((model.experts,), jnp.int32),
        ),
        kwargs={"transpose_rhs": True},
        flops=2 * rows * k * n,
        bytes_accessed=(rows * k + rows * n) * jnp.dtype(dtype).itemsize
        + experts_read * (k * n * jnp.dtype(weight_dtype).itemsize + scale_bytes),
        differentiable=(0,),
        tags=(phase, model.name, fmt),
        make_args=make_args,
    )


# Serving decode grid (T = 1..256; E = 8, 64, 128; top-k 2 and 8), forward only; compiled for
# v5e and v6e by benchmarks/serving.py. CASES below holds what every CI run compiles.
SERVING_CASES = [
    case(model, projection, "serve-decode", tokens, backward=False)
    for model in (MIXTRAL, OLMOE, QWEN3_MOE)
    for projection in ("gate_up", "down")
    for tokens in DECODE_TOKENS
]

# The registry's compile matrix (every generation, in CI): training shapes with their backward,
# one serving decode batch of the many-expert top-8 model, and CPU cases for kernel-hub bench.
CASES = (
    [
        case(model, projection, phase, tokens)
        for model in (MIXTRAL, FINE_GRAINED)
        for projection in ("gate_up", "down")
        for phase, tokens in TOKENS
    ]
    + [
        c
        for c in SERVING_CASES
        if c.name.startswith(QWEN3_MOE.name) and c.name.endswith("-serve-decode64")
    ]
    # quantized weights (training/prefill path): one small prefill per format, cheap to compile
    + [quantized_case(SMALL, "gate_up", "prefill", 256, fmt) for fmt in ("int8", "fp8")]
    + [
        case(SMALL, "gate_up", "decode", 16, jnp.float32, tags=(CPU_TAG,)),
        case(SMALL, "down", "prefill", 256, jnp.float32, tags=(CPU_TAG,)),
    ]
)


def torch_grouped_mm(lhs, rhs, group_sizes, transpose_rhs: bool = False) -> torch.Tensor:
    """torch.nn.functional.grouped_mm: what Transformers' ``grouped_mm`` experts run."""
    weights = rhs.transpose(-2, -1) if transpose_rhs else rhs
    offsets = torch.cumsum(group_sizes, 0, dtype=torch.int32)
    return torch.nn.functional.grouped_mm(lhs, weights, offs=offsets)


def kernel_hub_gmm(lhs, rhs, group_sizes, transpose_rhs: bool = False) -> torch.Tensor:
    """kernel-hub's gmm torch op (DLPack bridge to JAX, platform's default implementation)."""
    return gmm_op(lhs, rhs, group_sizes, transpose_rhs)


# Torch callables taking a case's arguments as tensors and its kwargs.
TORCH_IMPLEMENTATIONS = {"torch-grouped_mm": torch_grouped_mm, "torch-op": kernel_hub_gmm}


def mesh_cases() -> list[MeshCase]:
    """gmm and gmm_quantized (int8, fp8: scales split with their weight, whole 128-blocks) with k
    split (partial products summed: all-reduce) and n split; tgmm with k x n."""
    rows = jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((8,), jnp.int32)
    return [
        MeshCase(
            "gmm k x n bf16",
            lambda lhs, rhs, s: api.gmm(lhs, rhs, s),
            (rows, jax.ShapeDtypeStruct((8, 1024, 1024), jnp.bfloat16), sizes),
            ((None, "data"), (None, "data", "model"), (None,)),
            ("data", "model"),
            differentiable=(0, 1),
            forward_collectives={"all-reduce": 1},
            # No mesh-axis convention splits k or n: both inputs are gathered whole.
            auto_forward_collectives={"all-gather": 2},
            auto_backward_collectives={"all-gather": 2},
        ),
        *(
            MeshCase(
                f"gmm_quantized {fmt} k x n",
                lambda lhs, weight, scale, s: api.gmm_quantized(lhs, weight, scale, s),
                (
                    jax.ShapeDtypeStruct((512, 512), jnp.bfloat16),
                    jax.ShapeDtypeStruct((8, 512, 512), dtype),
                    jax.ShapeDtypeStruct(scale_shape, jnp.float32),
                    sizes,
                ),
                ((None, "data"), (None, "model", "data"), scale_spec, (None,)),
                ("data", "model"),
                differentiable=(0,),
                forward_collectives={"all-reduce": 1},
                backward_collectives={"all-reduce": 1},
                # No mesh-axis convention splits k or n: the inputs are gathered whole (the
                # backward gathers weight and scale; lhs's gradient is summed back to its split).
                auto_forward_collectives={"all-gather": 3},
                auto_backward_collectives={"all-gather": 2, "all-reduce": 1},
            )
            for fmt, dtype, scale_shape, scale_spec in (
                ("int8", jnp.int8, (8, 512), (None, "model")),
                ("fp8", jnp.float8_e4m3fn, (8, 4, 4), (None, "model", "data")),
            )
        ),
        MeshCase(
            "expert-parallel MoE E16 top-2 bf16 (ragged_all_to_all)",
            functools.partial(
                expert_parallel.moe_ep, activation=expert_parallel.swiglu, transport="ragged"
            ),
            (
                jax.ShapeDtypeStruct((1024, 512), jnp.bfloat16),
                jax.ShapeDtypeStruct((1024, 2), jnp.int32),
                jax.ShapeDtypeStruct((1024, 2), jnp.bfloat16),
                jax.ShapeDtypeStruct((16, 512, 512), jnp.bfloat16),
                jax.ShapeDtypeStruct((16, 256, 512), jnp.bfloat16),
            ),
            (("ep",),) * 5,
            ("ep",),
            differentiable=(0, 3, 4),
            forward_collectives={"ragged-all-to-all": 2, "all-gather": 1},
            backward_collectives={"ragged-all-to-all": 2},
            control=False,
        ),
        MeshCase(
            "tgmm k x n bf16",
            lambda lhs, grad, s: api.tgmm(lhs, grad, s),
            (rows, rows, sizes),
            ((None, "data"), (None, "model"), (None,)),
            ("data", "model"),
            auto_forward_collectives={"all-gather": 2},
        ),
    ]
