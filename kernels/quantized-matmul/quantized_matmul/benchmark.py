"""Representative shapes with FLOPs and bytes per call (bench and TPU compile checks), and the
torch paths ``kernel-hub bench`` times beside the JAX implementations.

Cases are Llama-3-8B's projections (hidden 4096, intermediate 14336, 8 KV heads of 128) at decode
batches 1 and 256 and an 8k prefill. ``bytes_accessed`` is the hand-count bound: activations, the
quantized weight with its scales and the output, each once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

from kernel_hub.kernel_api import CPU_TAG, KernelCase, MeshCase

from . import api
from .api import quantized_matmul, quantized_matmul_int4, scale_shape, weight_format
from .reference import dequantize

quantized_matmul_op = api.quantized_matmul.torch
quantized_matmul_int4_op = api.quantized_matmul_int4.torch

WEIGHT_DTYPES = {"fp8": jnp.float8_e4m3fn, "int8": jnp.int8, "int4": jnp.int32, "w8a8": jnp.int8,
                 "int4z": jnp.int32}  # fmt: skip
BASE_FORMATS = {"w8a8": "int8", "int4z": "int4"}
"""case format -> the weight format it stores (w8a8: int8 with int8 activations; int4z: int4
with per-group zero points)."""
# projection -> (out, in)
LLAMA3_8B = {
    "q_proj": (4096, 4096),
    "k_proj": (1024, 4096),
    "gate_proj": (14336, 4096),
    "down_proj": (4096, 14336),
}
PREFILL = 8192


def weight_shape(fmt: str, out: int, inner: int) -> tuple[int, int]:
    """The stored weight shape of an [out, in] layer: int4 GPTQ-packed [in / 8, out]."""
    return (inner // 8, out) if BASE_FORMATS.get(fmt, fmt) == "int4" else (out, inner)


def case(name: str, rows: int, out: int, inner: int, fmt: str, dtype=jnp.bfloat16, tags=()):
    """One ``quantized_matmul`` (``quantized_matmul_int4``) of an [out, in] ``fmt`` weight over
    ``rows`` tokens; "w8a8": int8 weights with ``activations="int8"`` (forward only); "int4z":
    int4 with per-group zero points."""
    base = BASE_FORMATS.get(fmt, fmt)
    scales = scale_shape(base, out, inner)
    stored = weight_shape(fmt, out, inner)
    itemsize = jnp.dtype(dtype).itemsize
    zeros = (jax.ShapeDtypeStruct(scales, jnp.int32),) if fmt == "int4z" else ()

    def make_args(rng: np.random.Generator):
        x = rng.standard_normal((rows, inner), dtype=np.float32).astype(dtype)
        if base == "int4":  # uniform nibbles, any bit pattern of the packed words
            q = rng.integers(-(2**31), 2**31, stored, dtype=np.int64).astype(np.int32)
            scale = np.full(scales, 1 / 4 / np.sqrt(inner), np.float32)
            z = (rng.integers(0, 16, scales, dtype=np.int32),) if zeros else ()
            return x, jnp.asarray(q), scale, *z
        w = rng.standard_normal((out, inner), dtype=np.float32)
        q = np.clip(np.round(w * 32), -127, 127) if fmt in ("int8", "w8a8") else w
        scale = np.full(scales, 1 / 32 / np.sqrt(inner), np.float32)
        return x, jnp.asarray(q).astype(WEIGHT_DTYPES[fmt]), scale

    return KernelCase(
        name=name,
        fn=quantized_matmul_int4 if base == "int4" else quantized_matmul,
        args=(
            jax.ShapeDtypeStruct((rows, inner), dtype),
            jax.ShapeDtypeStruct(stored, WEIGHT_DTYPES[fmt]),
            jax.ShapeDtypeStruct(scales, jnp.float32),
            *zeros,
        ),
        flops=2 * rows * out * inner,
        bytes_accessed=(rows * inner + rows * out) * itemsize
        + (out * inner // 2 if base == "int4" else out * inner)
        + 4 * int(np.prod(scales)) * (1 + len(zeros)),
        kwargs={"activations": "int8"} if fmt == "w8a8" else {},
        differentiable=() if fmt == "w8a8" else (0,),
        tags=(fmt, *tags),
        make_args=make_args,
    )


def _name(proj: str, fmt: str, phase: str, rows: int) -> str:
    return f"llama3-8b-{proj}-{fmt}-{phase}{rows}"


# fp8 (the checkpoints people serve) at the decode batches' ends and prefill; int8 at a few.
# ``scripts/quantized_matmul_bytes.py`` covers decode 1/16/64/256 for every projection.
SELECTED = [("fp8", proj, "decode", rows) for proj in LLAMA3_8B for rows in (1, 256)]
SELECTED += [("fp8", proj, "prefill", PREFILL) for proj in ("gate_proj", "down_proj")]
SELECTED += [("int8", proj, "decode", 64) for proj in ("q_proj", "down_proj")]
SELECTED += [("int8", "down_proj", "prefill", PREFILL)]
SELECTED += [
    ("int4", proj, "decode", rows) for proj in ("q_proj", "down_proj") for rows in (1, 256)
]
SELECTED += [("int4", "gate_proj", "decode", 64), ("int4", "down_proj", "prefill", PREFILL)]
SELECTED += [("int4z", "down_proj", "decode", 64)]  # zero points: their own program
SELECTED += [("w8a8", "q_proj", "decode", 64), ("w8a8", "down_proj", "prefill", PREFILL)]

CASES = [
    case(_name(proj, fmt, phase, rows), rows, *LLAMA3_8B[proj], fmt, tags=(phase,))
    for fmt, proj, phase, rows in SELECTED
] + [
    # small enough for Pallas interpret mode on a 2-core CPU; ragged fp8 blocks (out 576)
    case("small-fp8-576x512-f32", 8, 576, 512, "fp8", jnp.float32, tags=(CPU_TAG,)),
    case("small-int8-256x384-bf16", 16, 256, 384, "int8", tags=(CPU_TAG,)),
    case("small-int4-256x1024-bf16", 16, 256, 1024, "int4", tags=(CPU_TAG,)),
]


def torch_dequantized_linear(x, weight, scale, zeros=None) -> torch.Tensor:
    """What a torch user runs without the kernel: dequantize the whole weight, then a Linear."""
    fmt = weight_format(weight)
    stored = weight.numpy() if fmt == "int4" else weight.float().numpy()
    z = None if zeros is None else jnp.asarray(zeros.numpy())
    w = dequantize(jnp.asarray(stored), jnp.asarray(scale.numpy()), fmt, jnp.float32, z)
    w = np.asarray(w)
    w = torch.from_numpy(w.T.copy() if fmt == "int4" else w)
    return torch.nn.functional.linear(x, w.to(x.dtype))


def kernel_hub_quantized_matmul(x, weight, scale, zeros=None) -> torch.Tensor:
    """kernel-hub's quantized_matmul torch op (quantized_matmul_int4 for int4; DLPack bridge to
    JAX, the platform's default)."""
    if weight.dtype == torch.int32:
        return quantized_matmul_int4_op(x, weight, scale, None, None, zeros)
    return quantized_matmul_op(x, weight, scale)


# Torch callables taking a case's arguments as tensors and its kwargs.
TORCH_IMPLEMENTATIONS = {
    "torch-dequantized": torch_dequantized_linear,
    "torch-op": kernel_hub_quantized_matmul,
}


def mesh_cases() -> list[MeshCase]:
    """Weight out dim over model, k over data (partial sums: one all-reduce), scales following;
    int8 and fp8; int4's n over model with k whole."""
    x = jax.ShapeDtypeStruct((8, 1024), jnp.bfloat16)
    return [
        MeshCase(
            f"quantized_matmul {fmt} n over model, k over data",
            lambda x, weight, scale: api.quantized_matmul(x, weight, scale),
            (
                x,
                jax.ShapeDtypeStruct((1024, 1024), dtype),
                jax.ShapeDtypeStruct(scale_shape, jnp.float32),
            ),
            ((None, "data"), ("model", "data"), scale_spec),
            ("data", "model"),
            differentiable=(0,),
            forward_collectives={"all-reduce": 1},
            # No mesh-axis convention splits a weight's k: the inputs are gathered to the
            # conventional placement instead of summing partial products.
            auto_forward_collectives={"all-gather": 1},
            auto_backward_collectives={"all-gather": 1},
            xla_backward=True,  # the activations' gradient is XLA's (whole dequantized weight)
        )
        for fmt, dtype, scale_shape, scale_spec in (
            ("int8", jnp.int8, (1024,), ("model",)),
            ("fp8", jnp.float8_e4m3fn, (8, 8), ("model", "data")),
        )
    ] + [
        # int4 (asymmetric): the packed rows and the scale and zero groups are k at 1/8 and
        # 1/128, so k stays whole and n splits; tokens split freely: no collective.
        MeshCase(
            "quantized_matmul int4 n over model, tokens over data",
            lambda x, weight, scale, zeros: api.quantized_matmul_int4(x, weight, scale, zeros),
            (
                x,
                jax.ShapeDtypeStruct((1024 // 8, 1024), jnp.int32),
                jax.ShapeDtypeStruct((1024 // 128, 1024), jnp.float32),
                jax.ShapeDtypeStruct((1024 // 128, 1024), jnp.int32),
            ),
            (("data", None), (None, "model"), (None, "model"), (None, "model")),
            ("data", "model"),
            differentiable=(0,),
            backward_collectives={"all-reduce": 1},  # dx sums over the split n
            # On an Auto mesh the boundary places inputs by the mesh-axis conventions, which are
            # not these specs: the partitioner reshards with 3 all-gathers (measured, v5e 2x2).
            auto_forward_collectives={"all-gather": 3},
            auto_backward_collectives={"all-gather": 3, "all-reduce": 1},
            xla_backward=True,
        )
    ]
