"""The Pallas gated delta rule compiles for every TPU generation at Qwen3-Next-80B-A3B's layer size
(16 q/k heads, 32 value heads, head dims 128): prefill of 8k tokens forward and backward, decode of
a batch of 64. Memory figures (``memory_analysis()`` of a deviceless compile: a model, not a
measurement) are printed and recorded; docs/hybrid-models.md tabulates them."""

from __future__ import annotations

import pytest

from kernel_hub import get_kernel
from kernel_hub.bench.compile_check import compile_case
from kernel_hub.topologies import DEFAULT_GENERATIONS

gdr = get_kernel("gated-delta-rule")

pytestmark = [pytest.mark.tpu_compile, pytest.mark.slow]

# The backward (XLA, through the chunked form) takes 15-50 s to compile a generation on a loaded
# 2-core host: one generation here; docs/hybrid-models.md has all four.
CELLS = [
    *((g, "qwen3-next-prefill-8k", "forward") for g in DEFAULT_GENERATIONS),
    *((g, "qwen3-next-decode-b64", "forward") for g in DEFAULT_GENERATIONS),
    ("v5e", "qwen3-next-prefill-8k", "backward"),
]


@pytest.mark.parametrize(("generation", "case_name", "direction"), CELLS)
def test_model_size_compiles(generation, case_name, direction, record_property):
    case = next(c for c in gdr.benchmark.CASES if c.name == case_name)
    result = compile_case("gated-delta-rule", case, generation, direction, implementation="pallas")
    assert result.ok, f"{generation} {case_name} {direction}: {result.error}"
    mib = {name: round(size / 2**20, 1) for name, size in result.memory.items()}
    record_property("compile_seconds", round(result.seconds, 2))
    record_property("memory_mib", mib)
    print(f"{generation} {case_name} {direction}: {result.seconds:.1f} s, MiB {mib}")
