"""Representative fused-experts calls with FLOPs and bytes per call (bench and TPU compile
checks), the MoE layer sizes of the issue's models, and the torch path ``kernel-hub bench`` times.

Bytes count what a decode step must read: the weights (and scales) of the experts that receive
rows, at most ``min(E, T * k)`` of them, plus the activations in and out.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kernel_hub.kernel_api import CPU_TAG, KernelCase, MeshCase

from . import api, expert_parallel, quant
from .api import fused_experts
from .blocks import lane_padded

fused_experts_op = api.fused_experts.torch


class MoEShape(NamedTuple):
    name: str
    experts: int
    hidden: int
    intermediate: int
    top_k: int
    activation: str = "silu"
    transposed: bool = False
    interleaved: bool = False
    bias: bool = False
    lane_groups: bool = False
    """mxfp4 scales with their group axis padded to 128 (``padding``'s layout)."""


MIXTRAL = MoEShape("mixtral-8x7b", 8, 4096, 14336, 2)
QWEN3_MOE = MoEShape("qwen3-30b-a3b", 128, 2048, 768, 8)
GPT_OSS = MoEShape("gpt-oss-120b", 128, 2880, 2880, 4, "gpt_oss", True, True, True)
DEEPSEEK_V3 = MoEShape("deepseek-v3", 256, 7168, 2048, 8)
MODELS = (MIXTRAL, QWEN3_MOE, GPT_OSS, DEEPSEEK_V3)
SMALL = MoEShape("small-e8", 8, 256, 512, 2)
GPT_OSS_MXFP4 = MoEShape("gpt-oss-mxfp4-1024", 16, 1024, 1024, 4, "gpt_oss", False, True, True)
"""GPT-OSS's experts in its MXFP4 checkpoint layout ([E, out, in / 2]) at H = I = 1024 (compile
cells). At GPT-OSS's own 2880 unpadded, the down block would span the whole I (no 256-multiple
divides 2880) and not fit VMEM; ``prepared(GPT_OSS, "mxfp4")`` (H = I = 3072) is what runs."""


def prepared(model: MoEShape, quantization: str | None = None) -> MoEShape:
    """The layer as the Transformers integration hands it to the kernel: weights zero-padded
    once to ``blocks.lane_padded`` sizes (GPT-OSS: H 2880 -> 2944; mxfp4 H = I -> 3072 and
    scale groups to 128), so no call relayouts them (see ``padding``)."""
    if quantization not in (None, "int8", "mxfp4"):
        return model
    mxfp4 = quantization == "mxfp4"
    if mxfp4:  # GPT-OSS's MXFP4 checkpoint layout is [E, out, in / 2]
        model = model._replace(transposed=False)
    hidden, inter = lane_padded(
        model.hidden, model.intermediate, transposed=model.transposed,
        interleaved=model.interleaved, packing=2 if mxfp4 else 1,
    )  # fmt: skip
    if (hidden, inter) == (model.hidden, model.intermediate):
        return model
    return model._replace(
        name=f"{model.name}-padded", hidden=hidden, intermediate=inter, lane_groups=mxfp4
    )


def scale_shapes(model: MoEShape, quantization: str) -> list[tuple[int, ...]]:
    shapes = [quant.scale_shape(quantization, s) for s in weight_shapes(model, quantization)]
    if model.lane_groups:
        shapes = [(*s[:2], -(-s[2] // 128) * 128) for s in shapes]
    return shapes


def weight_shapes(
    model: MoEShape, quantization: str | None = None
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Stored shapes (mxfp4: two values per byte along the contraction axis)."""
    e, h, i = model.experts, model.hidden, model.intermediate
    if model.transposed:
        return (e, h, 2 * i), (e, i, h)
    packing = 2 if quantization == "mxfp4" else 1
    return (e, 2 * i, h // packing), (e, h, i // packing)


def routed_ids(rng: np.random.Generator, tokens: int, model: MoEShape) -> np.ndarray:
    """Each token picks ``top_k`` distinct experts uniformly at random."""
    return np.argsort(rng.random((tokens, model.experts)), axis=1)[:, : model.top_k].astype(
        np.int32
    )


def weight_bytes(model: MoEShape, tokens: int, quantization: str | None, dtype) -> int:
    """Hand count: bytes of the weights (and scales) of the experts a step can touch."""
    experts = min(model.experts, tokens * model.top_k)
    per_expert = 3 * model.intermediate * model.hidden
    if quantization is None:
        return experts * per_expert * jnp.dtype(dtype).itemsize
    scales = sum(int(np.prod(s[1:])) for s in scale_shapes(model, quantization))
    packing = 2 if quantization == "mxfp4" else 1
    scale_itemsize = jnp.dtype(quant.SCALE_DTYPES[quantization]).itemsize
    return experts * (per_expert // packing + scale_itemsize * scales)


def case(
    model: MoEShape,
    tokens: int,
    quantization: str | None = None,
    dtype=jnp.bfloat16,
    tags: tuple[str, ...] = (),
) -> KernelCase:
    """One fused-experts call of ``model`` for ``tokens`` tokens."""
    w1_shape, w2_shape = weight_shapes(model, quantization)
    w_dtype = quant.WEIGHT_DTYPES[quantization] if quantization else dtype
    e, h, i = model.experts, model.hidden, model.intermediate
    args = [
        jax.ShapeDtypeStruct((tokens, h), dtype),
        jax.ShapeDtypeStruct((tokens, model.top_k), jnp.int32),
        jax.ShapeDtypeStruct((tokens, model.top_k), dtype),
        jax.ShapeDtypeStruct(w1_shape, w_dtype),
        jax.ShapeDtypeStruct(w2_shape, w_dtype),
        jax.ShapeDtypeStruct((e, 2 * i), dtype) if model.bias else None,
        jax.ShapeDtypeStruct((e, h), dtype) if model.bias else None,
    ]
    if quantization:
        args += [
            jax.ShapeDtypeStruct(s, quant.SCALE_DTYPES[quantization])
            for s in scale_shapes(model, quantization)
        ]

    def make_args(rng: np.random.Generator):
        x = rng.standard_normal((tokens, h), dtype=np.float32).astype(dtype)
        weights = rng.random((tokens, model.top_k), dtype=np.float32).astype(dtype)
        out = [x, routed_ids(rng, tokens, model), weights]
        for shape in (w1_shape, w2_shape):
            w = rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[-1])
            out.append(w)
        if model.bias:
            out += [rng.standard_normal((e, 2 * i), dtype=np.float32).astype(dtype),
                    rng.standard_normal((e, h), dtype=np.float32).astype(dtype)]  # fmt: skip
        else:
            out += [None, None]
        if quantization == "mxfp4":  # any byte is two fp4 values; exponents near 2 ** -6
            out[3], out[4] = (rng.integers(0, 256, s, dtype=np.uint8) for s in (w1_shape, w2_shape))
            out += [rng.integers(118, 124, s, dtype=np.uint8)
                    for s in scale_shapes(model, quantization)]  # fmt: skip
        elif quantization:
            q1, s1 = quant.quantize(jnp.asarray(out[3]), quantization)
            q2, s2 = quant.quantize(jnp.asarray(out[4]), quantization)
            out[3], out[4] = np.asarray(q1), np.asarray(q2)
            out += [np.asarray(s1), np.asarray(s2)]
        else:
            out[3], out[4] = out[3].astype(dtype), out[4].astype(dtype)
        return tuple(out)

    rows = tokens * model.top_k
    itemsize = jnp.dtype(dtype).itemsize
    suffix = f"-{quantization}" if quantization else ""
    return KernelCase(
        name=f"{model.name}-decode{tokens}{suffix}",
        fn=fused_experts,
        args=tuple(args),
        kwargs={
            "activation": model.activation,
            "transposed": model.transposed,
            "interleaved": model.interleaved,
            "quantization": quantization,
        },
        flops=2 * rows * 3 * i * h,
        bytes_accessed=weight_bytes(model, tokens, quantization, dtype) + 2 * tokens * h * itemsize,
        tags=("decode", model.name, *tags),
        make_args=make_args,
    )


# The registry's compile matrix (every generation, in CI): one decode batch per weight format
# and layout, small enough to compile in seconds; the model-size grid is in
# benchmarks/moe_decode.py and tests/test_fused_moe_tpu_compile.py.
CASES = [
    case(QWEN3_MOE, 64),
    case(GPT_OSS, 16),
    case(MIXTRAL, 16, "int8"),
    case(SMALL._replace(hidden=512), 32, "fp8"),
    case(GPT_OSS_MXFP4, 16, "mxfp4"),
    case(SMALL, 32, "w8a8"),
    case(SMALL, 16, dtype=jnp.float32, tags=(CPU_TAG,)),
    case(SMALL, 64, tags=(CPU_TAG,)),
]


def kernel_hub_fused_experts(*args, **kwargs):
    """kernel-hub's fused_experts torch op (DLPack bridge to JAX, the default implementation)."""
    return fused_experts_op(*args, **kwargs)


TORCH_IMPLEMENTATIONS = {"torch-op": kernel_hub_fused_experts}


def mesh_cases() -> list[MeshCase]:
    """Tokens over a data axis: each shard runs the kernel on its tokens, no collective; and
    experts over an ep axis (``fused_experts_ep``): one all-reduce of the f32 partial sums."""
    return [
        MeshCase(
            "tokens over data, E8 top-2 bf16",
            lambda x, ids, w, w1, w2: api.fused_experts(x, ids, w, w1, w2),
            (
                jax.ShapeDtypeStruct((64, 256), jnp.bfloat16),
                jax.ShapeDtypeStruct((64, 2), jnp.int32),
                jax.ShapeDtypeStruct((64, 2), jnp.bfloat16),
                jax.ShapeDtypeStruct((8, 512, 256), jnp.bfloat16),
                jax.ShapeDtypeStruct((8, 256, 256), jnp.bfloat16),
            ),
            (("data", None), ("data", None), ("data", None), (None,) * 3, (None,) * 3),
            ("data",),
        ),
        MeshCase(
            "experts over ep (fused_experts_ep), E16 top-2 bf16",
            expert_parallel.fused_experts_ep,
            (
                jax.ShapeDtypeStruct((64, 256), jnp.bfloat16),
                jax.ShapeDtypeStruct((64, 2), jnp.int32),
                jax.ShapeDtypeStruct((64, 2), jnp.bfloat16),
                jax.ShapeDtypeStruct((16, 512, 256), jnp.bfloat16),
                jax.ShapeDtypeStruct((16, 256, 256), jnp.bfloat16),
            ),
            ((None, None), (None, None), (None, None), ("ep", None, None), ("ep", None, None)),
            ("ep",),
            forward_collectives={"all-reduce": 1},
            control=False,
        ),
    ]
