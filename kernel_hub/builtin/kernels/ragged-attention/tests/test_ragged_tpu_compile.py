"""The Pallas kernels compile for real TPU generations (deviceless, through libtpu).

Mosaic rejects illegal block shapes and VMEM overflow per generation, which interpret mode never
checks. One decode case per kernel and generation here; ``kernel-hub compile-check
ragged-attention`` and ``benchmarks/serving.py`` compile all of them.
"""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from kernel_hub.bench.compile_check import compile_case

pytest.importorskip("libtpu")
pytestmark = pytest.mark.tpu_compile

CELLS = [
    ("v5e", "ragged-decode-b64-ctx2k"),
    ("v6e", "paged-decode-b256-ctx32k-page256-shared-cache"),
]


@pytest.mark.parametrize(("generation", "name"), CELLS)
def test_decode_case_compiles(ragged, generation, name):
    case = next(c for c in ragged.benchmark.CASES if c.name == name)
    result = compile_case(ragged.manifest.name, case, generation)
    print(f"{generation} {name}: {result.seconds:.1f} s, {result.memory}")
    assert result.ok, result.error
    assert result.memory["temp_size"] < 64 * 2**20, "the kernels must not copy K/V or pages"


def test_untileable_page_size_is_declined_before_compiling(ragged):
    case = ragged.benchmark.paged_decode_case(8, 96, page_size=12)
    result = compile_case(ragged.manifest.name, case, "v5e")
    assert result.skipped and "page_size=12 cannot be tiled" in result.error, result
    assert jnp.dtype(case.args[0].dtype) == jnp.bfloat16
