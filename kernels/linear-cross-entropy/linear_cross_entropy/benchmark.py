"""Representative shapes with FLOPs and bytes per call (bench and TPU compile checks), and the
torch paths ``kernel-hub bench`` times beside the JAX implementations."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

from kernel_hub.kernel_api import CPU_TAG, KernelCase, MeshCase

from . import api
from .api import linear_cross_entropy

linear_cross_entropy_op = api.linear_cross_entropy.torch

# (name, tokens, hidden, vocab): a training micro-batch through Llama-3-8B's and Qwen3-8B's heads
# (the compile matrix compiles these; the 8k/32k memory study is
# benchmarks/linear_cross_entropy_memory.py).
SHAPES = (
    ("llama3-8b-head-2k", 2048, 4096, 128256),
    ("qwen3-8b-head-2k", 2048, 4096, 151936),
    # Llama-3-70B's head on one chip of a tensor-parallel 8 split (hidden 8192, the vocabulary's
    # 1/8): at this hidden size the whole-tile forward body overflowed v5e's scoped VMEM before
    # 1.2.1 chunked it (model-bench's llama-3-70b training step on v5e 4x4 stopped there).
    ("llama3-70b-head-tp8-4k", 4096, 8192, 16032),
)

# (name, tokens, hidden, vocab, dtype): small enough for Pallas interpret mode on a 2-core CPU.
CPU_SHAPES = (
    ("tiny-512-h256-v2048-f32", 512, 256, 2048, jnp.float32),
    ("tiny-512-h256-v2048", 512, 256, 2048, jnp.bfloat16),
)


def case(
    name: str, tokens: int, hidden: int, vocab: int, dtype=jnp.bfloat16, tags=()
) -> KernelCase:
    itemsize = jnp.dtype(dtype).itemsize

    def make_args(rng: np.random.Generator):
        hidden_states = rng.standard_normal((tokens, hidden), dtype=np.float32)
        weight = rng.standard_normal((vocab, hidden), dtype=np.float32) / np.sqrt(hidden)
        labels = rng.integers(0, vocab, tokens).astype(np.int32)
        return hidden_states.astype(dtype), weight.astype(dtype), labels

    return KernelCase(
        name=name,
        fn=linear_cross_entropy,
        args=(
            jax.ShapeDtypeStruct((tokens, hidden), dtype),
            jax.ShapeDtypeStruct((vocab, hidden), dtype),
            jax.ShapeDtypeStruct((tokens,), jnp.int32),
        ),
        # the logits matmul, plus exp/compare/sum per logit
        flops=2 * tokens * vocab * hidden + 6 * tokens * vocab,
        # read hidden and the head once (the compulsory traffic; the kernel re-reads the head per
        # token block), labels in, a scalar out
        bytes_accessed=(tokens + vocab) * hidden * itemsize + 4 * tokens + 4,
        differentiable=(0, 1),
        tags=tuple(tags),
        op="token_statistics",
        make_args=make_args,
    )


CASES = [case(*shape) for shape in SHAPES] + [
    case(name, tokens, hidden, vocab, dtype, tags=(CPU_TAG,))
    for name, tokens, hidden, vocab, dtype in CPU_SHAPES
]


def torch_linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor
) -> torch.Tensor:
    """What Transformers runs: the logits, then cross_entropy in f32."""
    logits = torch.nn.functional.linear(hidden, weight)
    return torch.nn.functional.cross_entropy(logits.float(), labels.long())


def kernel_hub_linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor
) -> torch.Tensor:
    """kernel-hub's linear_cross_entropy torch op (platform's default implementation)."""
    return linear_cross_entropy_op(hidden, weight, labels)


# Torch callables taking a case's arguments as tensors and its kwargs.
TORCH_IMPLEMENTATIONS = {
    "torch": torch_linear_cross_entropy,
    "torch-op": kernel_hub_linear_cross_entropy,
}


def mesh_cases() -> list[MeshCase]:
    """The loss with tokens over ``data`` and the head's vocabulary over ``model``: two small
    all-reduces of [tokens] vectors forward (max, sums) and none of the weight."""
    shapes = (
        jax.ShapeDtypeStruct((2048, 512), jnp.bfloat16),
        jax.ShapeDtypeStruct((4096, 512), jnp.bfloat16),
        jax.ShapeDtypeStruct((2048,), jnp.int32),
    )
    return [
        MeshCase(
            "tokens over data x model bf16",
            lambda h, w, labels: api.linear_cross_entropy(h, w, labels),
            shapes,
            (("data", None), (None, None), ("data",)),
            ("data", "model"),
            differentiable=(0, 1),
            backward_collectives={"all-reduce": 1},
        ),
        MeshCase(
            "vocab-parallel head over model, tokens over data bf16",
            lambda h, w, labels: api.linear_cross_entropy(h, w, labels),
            shapes,
            (("data", None), ("model", None), ("data",)),
            ("data", "model"),
            differentiable=(0, 1),
            forward_collectives={"all-reduce": 2},
            backward_collectives={"all-reduce": 3},
        ),
    ]
