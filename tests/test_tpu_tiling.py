"""The block-size rules Pallas TPU kernels share (``kernel_api.tiling``)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kernel_hub.kernel_api import tiling


@pytest.mark.parametrize(
    ("dtype", "multiple"),
    [(jnp.float32, 8), (jnp.int32, 8), (jnp.bfloat16, 16), (jnp.float16, 16), (jnp.int8, 32)],
)
def test_sublane_multiple(dtype, multiple):
    assert tiling.sublane_multiple(dtype) == multiple


def test_vmem_bytes_per_row_counts_buffers_and_f32_temporaries():
    assert tiling.vmem_bytes_per_row(128, 2, streamed=3, f32_temporaries=5) == 128 * (12 + 20)
    assert tiling.vmem_bytes_per_row(128, 4, streamed=1, f32_temporaries=0, buffers=3) == 1536


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 100, 5000, 100_000])
@pytest.mark.parametrize("bytes_per_row", [1, 4096, 3 * 2**20, 2**30])
def test_row_block_is_legal_and_within_budget_when_it_can_be(dtype, rows, bytes_per_row):
    block = tiling.row_block(rows, bytes_per_row, dtype)
    multiple = tiling.sublane_multiple(dtype)
    assert tiling.row_block_problem(rows, block, dtype) is None
    assert 1 <= block <= max(rows, multiple) and block <= tiling.MAX_BLOCK_ROWS
    if block > multiple:  # one tile is the floor, even over budget
        assert block * bytes_per_row <= tiling.VMEM_BUDGET_BYTES
    if block < rows and block + multiple <= tiling.MAX_BLOCK_ROWS:
        assert (block + multiple) * bytes_per_row > tiling.VMEM_BUDGET_BYTES, "not the largest"


def test_row_block_respects_a_given_budget():
    assert tiling.row_block(4096, 1024, jnp.float32, budget=64 * 1024) == 64


@pytest.mark.parametrize(
    ("rows", "block", "dtype", "problem"),
    [
        (100, 100, jnp.bfloat16, None),
        (100, 32, jnp.bfloat16, None),
        (100, 8, jnp.bfloat16, "block_rows=8 must equal rows (100) or be a multiple of 16"),
        (100, 0, jnp.float32, "block_rows=0 must equal rows (100) or be a multiple of 8"),
    ],
)
def test_row_block_problem(rows, block, dtype, problem):
    assert tiling.row_block_problem(rows, block, dtype) == problem


def test_row_block_problem_in_the_kernels_words():
    problem = tiling.row_block_problem(100, 12, jnp.float32, name="block_tokens", axis="tokens")
    assert problem == "block_tokens=12 must equal tokens (100) or be a multiple of 8"


def test_vmem_budget_per_generation():
    """The generation's default scoped VMEM less the reserve, at most the cap; without a known
    generation the smallest one's (v4, 16 MiB), so blocks fit everywhere."""
    mib = 1 << 20
    assert tiling.vmem_budget("v4", reserve=4 * mib) == 12 * mib
    assert tiling.vmem_budget("v5e", reserve=4 * mib, cap=40 * mib) == 40 * mib
    assert tiling.vmem_budget("v5p", reserve=4 * mib) == 60 * mib
    assert tiling.vmem_budget(reserve=6 * mib) == tiling.vmem_budget("TPU v9", reserve=6 * mib)
    assert tiling.vmem_budget(reserve=6 * mib) == 10 * mib
    assert tiling.VMEM_BUDGET_BYTES == tiling.vmem_budget(reserve=8 * mib) == 8 * mib


def test_compiler_params_carry_the_semantics():
    params = tiling.compiler_params("parallel", "arbitrary", vmem_limit_bytes=2**24)
    assert tuple(params.dimension_semantics) == ("parallel", "arbitrary")
    assert params.vmem_limit_bytes == 2**24


@pytest.mark.parametrize(
    ("chunk", "problem"),
    [
        (64, None),
        (16, None),
        (24, "chunk=24 must be a positive multiple of 16"),
        (8, "chunk=8 must be a positive multiple of 16"),
        (0, "chunk=0 must be a positive multiple of 16"),
        (-16, "chunk=-16 must be a positive multiple of 16"),
    ],
)
def test_chunk_problem(chunk, problem):
    assert tiling.chunk_problem(chunk) == problem


@pytest.mark.parametrize(("platform", "interpreted"), [("cpu", True), ("tpu", False)])
def test_float64_reaches_pallas_only_in_interpret_mode(monkeypatch, platform, interpreted):
    from kernel_hub import dispatch
    from kernel_hub.kernel_api import float64_problem

    monkeypatch.setattr(dispatch, "jax_platform", lambda: platform)
    f32, f64 = jnp.zeros(2, jnp.float32), np.zeros(2, np.float64)
    assert float64_problem(f32, f32) is None
    expected = None if interpreted else "float64 runs only in interpret mode"
    assert float64_problem(f32, f64) == expected


def test_pallas_and_xla_table_orders_and_checks():
    from kernel_hub.kernel_api import PALLAS_FIRST_ON_TPU, pallas_and_xla

    table = pallas_and_xla("op", lambda x: "pallas", lambda x: "xla", lambda x: x or None)
    assert {p: table.order(p) for p in PALLAS_FIRST_ON_TPU} == dict(PALLAS_FIRST_ON_TPU)
    assert table.implementations["pallas"].platforms == ("tpu", "cpu")
    assert table.implementations["xla"].platforms == ("tpu", "gpu", "cpu")
    assert table.select(0, platform="tpu").name == "pallas"
    assert table.select("refused", platform="tpu").name == "xla"
    assert table(0) == "xla" and table(0, implementation="pallas") == "pallas"
