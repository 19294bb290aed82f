"""The Pallas kernels compile for real TPU generations (deviceless, through libtpu).

Mosaic rejects illegal block shapes and VMEM overflow per generation, which interpret mode never
checks. The registry's compile matrix (tests/bench/test_compile_matrix.py) compiles the
benchmark cases on every generation; here: the kernels read K/V and the pages in place (no
temporaries the size of the keys), and a page size the kernel cannot tile is declined first.
"""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from kernel_hub.bench.compile_check import compile_case

pytest.importorskip("libtpu")
pytestmark = pytest.mark.tpu_compile


@pytest.mark.parametrize(
    ("generation", "make"),
    [("v5e", "ragged_decode_case"), ("v6e", "paged_decode_case")],
)
def test_decode_reads_keys_in_place(ragged, generation, make):
    case = getattr(ragged.benchmark, make)(16, 4096)  # 64k keys: 128 MiB of bf16 K and V
    result = compile_case(ragged.manifest.name, case, generation)
    assert result.ok, result.error
    keys_bytes = 2 * 16 * 4096 * 8 * 128 * 2
    assert result.memory["argument_size"] > keys_bytes
    assert result.memory["temp_size"] < keys_bytes / 64, f"K/V copied: {result.memory}"


def test_untileable_page_size_is_declined_before_compiling(ragged):
    case = ragged.benchmark.paged_decode_case(8, 96, page_size=12)
    result = compile_case(ragged.manifest.name, case, "v5e")
    assert result.skipped and "page_size=12 cannot be tiled" in result.error, result
    assert jnp.dtype(case.args[0].dtype) == jnp.bfloat16


@pytest.mark.parametrize("generation", ["v5e", "v6e"])
def test_fp8_decode_reads_8bit_pages_in_place(ragged, generation):
    """The fp8 cache's decode cell: no copy or relayout of the pages or their scale rows (the
    scales are [P, Hkv, page], lane-dense), and the compiled program's bytes are the kernel's
    declared CostEstimate, which equals the hand count of one decode step (the compiler cannot
    see inside a Pallas call): one byte per cached element plus 4 per token and kv head."""
    case = ragged.benchmark.paged_decode_case(64, 32768, kv_dtype="float8_e4m3fn")
    result = compile_case(ragged.manifest.name, case, generation)
    assert result.ok, result.error
    pages_bytes = case.args[1].size  # one byte an element
    assert result.memory["argument_size"] > 2 * pages_bytes
    assert result.memory["temp_size"] < pages_bytes / 1024, f"pages copied: {result.memory}"
    hand_count = 2 * 64 * 32768 * 8 * (128 + 4) + 2 * 64 * 32 * 128 * 2
    assert result.bytes_accessed == case.bytes_accessed == hand_count
