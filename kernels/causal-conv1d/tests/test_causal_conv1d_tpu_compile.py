"""The Pallas causal convolution compiles for every TPU generation at Qwen3-Next-80B-A3B's size
(8192 channels, width 4): prefill of 8k tokens forward and backward, the decode update for a batch
of 64. Memory figures come from deviceless compiles (a model, not a measurement); docs/hybrid-
models.md tabulates them."""

from __future__ import annotations

import pytest

from kernel_hub import get_kernel
from kernel_hub.bench.compile_check import compile_case
from kernel_hub.topologies import DEFAULT_GENERATIONS

conv = get_kernel("causal-conv1d")

pytestmark = [pytest.mark.tpu_compile, pytest.mark.slow]


@pytest.mark.parametrize("generation", DEFAULT_GENERATIONS)
@pytest.mark.parametrize(
    ("case_name", "direction"),
    [
        ("qwen3-next-prefill-8k", "forward"),
        ("qwen3-next-prefill-8k", "backward"),
        ("qwen3-next-decode-b64", "forward"),
    ],
)
def test_model_size_compiles(generation, case_name, direction, record_property):
    case = next(c for c in conv.benchmark.CASES if c.name == case_name)
    result = compile_case("causal-conv1d", case, generation, direction, implementation="pallas")
    assert result.ok, f"{generation} {case_name} {direction}: {result.error}"
    mib = {name: round(size / 2**20, 1) for name, size in result.memory.items()}
    record_property("compile_seconds", round(result.seconds, 2))
    record_property("memory_mib", mib)
    print(f"{generation} {case_name} {direction}: {result.seconds:.1f} s, MiB {mib}")
