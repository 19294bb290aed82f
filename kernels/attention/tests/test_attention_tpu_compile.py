"""The Pallas kernels compile for real TPU generations (deviceless, through libtpu).

Mosaic rejects illegal block shapes and VMEM overflow per generation (v4 has 16 MiB scoped VMEM),
which interpret mode never checks. One representative shape per generation here, forward and
backward; benchmarks/attention_tpu_compile.py records every case on every generation.
"""

from __future__ import annotations

import os

import pytest
from attention_helpers import tpu_compile

# Several processes on this kind of host load libtpu at once; without a TPU that is harmless.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

pytestmark = pytest.mark.tpu_compile

PER_GENERATION = {
    "v4": "prefill-2k-gqa",
    "v5e": "decode-q1-kv32k-gqa",
    "v5p": "prefill-4k-window-d256-softcap",
    "v6e": "prefill-8k-gqa",
}


@pytest.mark.parametrize("generation", list(PER_GENERATION))
def test_compiles_forward_and_backward(attention, generation):
    pytest.importorskip("libtpu")
    case = next(c for c in attention.benchmark.CASES if c.name == PER_GENERATION[generation])
    for backward in (False, True):
        seconds, compiled = tpu_compile(case, generation, backward=backward)
        memory = compiled.memory_analysis()
        print(
            f"{generation} {case.name} {'backward' if backward else 'forward'}: "
            f"compiled in {seconds:.1f}s, temp {memory.temp_size_in_bytes} bytes"
        )
        assert "tpu_custom_call" in compiled.as_text(), "no Mosaic kernel in the compiled program"
