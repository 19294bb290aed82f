"""Model-size fused-experts calls compile for real TPU generations without a TPU, and their
compiled memory stays within the chip.

libtpu's deviceless topologies run the Mosaic compiler as on a TPU host, so block-shape and VMEM
mistakes fail here. Prints compile time and ``memory_analysis()`` figures (argument and
temporary HBM bytes); records them as test properties (``--junitxml``).
"""

from __future__ import annotations

import pytest

from kernel_hub import get_kernel
from kernel_hub.bench.compile_check import compile_case
from kernel_hub.topologies import DEFAULT_GENERATIONS

fused = get_kernel("fused-moe")
bench = fused.benchmark

pytestmark = [pytest.mark.tpu_compile, pytest.mark.slow]

# One model-size cell per generation: decode buckets up to the largest (512 tokens), the four
# model layouts, both quantized formats. (Prefill declines the fused kernel: the XLA path.)
CELLS = {
    "v4": (bench.QWEN3_MOE, 256, "int8"),
    "v5e": (bench.MIXTRAL, 512, "int8"),
    "v5p": (bench.GPT_OSS, 512, None),
    "v6e": (bench.DEEPSEEK_V3, 512, "fp8"),
}


@pytest.mark.parametrize("generation", DEFAULT_GENERATIONS)
def test_model_size_cell_compiles(generation, record_property):
    model, tokens, quantization = CELLS[generation]
    case = bench.case(model, tokens, quantization)
    result = compile_case("fused-moe", case, generation, "forward", implementation="pallas")
    assert result.ok, f"{generation} {case.name}: {result.error}"
    record_property("compile_seconds", round(result.seconds, 2))
    print(f"{generation} {case.name}: {result.seconds:.2f} s, memory {result.memory}")


def test_gpt_oss_weights_padded_once_are_not_copied_per_call(record_property):
    """GPT-OSS's H = 2880 puts no lane-aligned axis last in its [E, I, H] down weight: the TPU
    stores it in a compact layout and every call copied all of it (2.2 GB of temporaries at
    T = 16). The weights ``padding`` prepares (H = 2944) are read in place."""
    results = {}
    for model in (bench.GPT_OSS, bench.prepared(bench.GPT_OSS)):
        result = compile_case("fused-moe", bench.case(model, 16), "v5e", "forward")
        assert result.ok, result.error
        results[model.name] = result
        print(f"v5e {model.name} T=16: {result.memory}, bytes {result.bytes_accessed:.3g}")
    stock, padded = results.values()
    record_property("padded_temp_bytes", padded.memory["temp_size"])
    assert stock.memory["temp_size"] > 1e9  # the per-call copy of the down weights
    assert padded.memory["temp_size"] < 16 * 2**20
    assert padded.bytes_accessed < 0.5 * stock.bytes_accessed


@pytest.mark.parametrize("generation", ["v5e"])  # v6e compiles alike (temporaries 0.33 MB)
def test_gpt_oss_mxfp4_at_its_real_size_runs_the_kernel(generation, record_property):
    """GPT-OSS-120B's MXFP4 experts as ``padding`` stores them (H = I = 3072, scale groups 128):
    the Pallas kernel compiles (512-wide intermediate blocks fit VMEM), and no weight or scale is
    relaid out per call (temporaries below 1 MiB)."""
    case = bench.case(bench.prepared(bench.GPT_OSS, "mxfp4"), 16, "mxfp4")
    result = compile_case("fused-moe", case, generation, "forward")
    assert result.ok, result.error
    print(f"{generation} {case.name}: {result.memory}, bytes {result.bytes_accessed:.3g}")
    record_property("temp_bytes", result.memory["temp_size"])
    assert result.memory["temp_size"] < 2**20
