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
