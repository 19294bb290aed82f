"""The Pallas Mamba-2 scan compiles for every TPU generation at Mamba-2 2.7B's layer size (80 heads
of 64, one group, state 128, chunk 256): an 8k-token prefill forward and a batch-64 decode step.
Memory figures (``memory_analysis()`` of a deviceless compile: a model, not a measurement) are
printed and recorded. The 8k backward (XLA, through the chunked form) compiles too but takes
about 90 s on a loaded 2-core host, so it is not a CI cell (docs/mamba2-scan.md)."""

from __future__ import annotations

import pytest

from kernel_hub import get_kernel
from kernel_hub.bench.compile_check import compile_case
from kernel_hub.topologies import DEFAULT_GENERATIONS

m2 = get_kernel("mamba2-scan")

pytestmark = [pytest.mark.tpu_compile, pytest.mark.slow]

CELLS = [
    *((g, "mamba2-2.7b-prefill-8k") for g in DEFAULT_GENERATIONS),
    *((g, "mamba2-2.7b-decode-b64") for g in DEFAULT_GENERATIONS),
]


@pytest.mark.parametrize(("generation", "case_name"), CELLS)
def test_model_size_compiles(generation, case_name, record_property):
    case = next(c for c in m2.benchmark.CASES if c.name == case_name)
    result = compile_case("mamba2-scan", case, generation, "forward", implementation="pallas")
    assert result.ok, f"{generation} {case_name}: {result.error}"
    mib = {name: round(size / 2**20, 1) for name, size in result.memory.items()}
    record_property("compile_seconds", round(result.seconds, 2))
    record_property("memory_mib", mib)
    print(f"{generation} {case_name}: {result.seconds:.1f} s, MiB {mib}")
