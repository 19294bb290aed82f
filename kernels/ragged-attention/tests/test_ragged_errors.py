"""Bad input is a clear error before any kernel runs: block tables, head counts, offsets."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from kernel_hub.errors import KernelInputError, NoImplementationError


def _paged_inputs(lens=(5, 9), page=4, num_pages=6, max_pages=3):
    table = torch.full((len(lens), max_pages), -1, dtype=torch.int32)
    table[0, :2] = torch.tensor([0, 1])
    table[1, :3] = torch.tensor([2, 3, 4])
    q = torch.randn(len(lens), 4, 16)
    pages = torch.randn(num_pages, page, 2, 16)
    return q, pages, pages.clone(), table, torch.tensor(lens, dtype=torch.int32)


@pytest.fixture
def no_kernel_runs(ragged, monkeypatch):
    """Fails the test if a kernel (or the reference) is reached."""

    def reached(*args, **kwargs):
        raise AssertionError("a kernel ran before the input was checked")

    for table in (ragged.jax.RAGGED_TABLE, ragged.jax.PAGED_TABLE):
        for name, impl in list(table.implementations.items()):
            monkeypatch.setitem(table.implementations, name, dataclasses.replace(impl, fn=reached))


def test_block_table_pointing_past_the_cache(ragged, no_kernel_runs):
    q, k, v, table, lens = _paged_inputs()
    table[1, 2] = 6
    with pytest.raises(KernelInputError, match=r"block_table\[1, 2\] = 6 points past the cache"):
        ragged.paged_attention(q, k, v, table, lens)


def test_padding_entry_inside_a_sequence(ragged, no_kernel_runs):
    q, k, v, table, lens = _paged_inputs()
    table[1, 1] = -1
    with pytest.raises(KernelInputError, match=r"-1 is allowed only after them"):
        ragged.paged_attention(q, k, v, table, lens)


def test_sequence_longer_than_its_table(ragged, no_kernel_runs):
    q, k, v, table, lens = _paged_inputs(lens=(5, 13))
    with pytest.raises(KernelInputError, match="more than its 3 table entries"):
        ragged.paged_attention(q, k, v, table, lens)


def test_mismatched_head_counts(ragged, no_kernel_runs):
    q, k, v, table, lens = _paged_inputs()
    with pytest.raises(KernelInputError, match="3 kv heads must divide the 4 query heads"):
        ragged.paged_attention(
            q, k[:, :, :1].repeat(1, 1, 3, 1), v[:, :, :1].repeat(1, 1, 3, 1), table, lens
        )
    cu = torch.tensor([0, 2], dtype=torch.int32)
    with pytest.raises(KernelInputError, match="3 kv heads must divide the 4 query heads"):
        ragged.ragged_attention(
            torch.randn(2, 4, 16), torch.randn(2, 3, 16), torch.randn(2, 3, 16), cu, cu
        )
    with pytest.raises(KernelInputError, match="must both be"):
        ragged.ragged_attention(
            torch.randn(2, 4, 16), torch.randn(2, 2, 16), torch.randn(3, 2, 16), cu, cu
        )


def test_bad_offsets(ragged, no_kernel_runs):
    q, k = torch.randn(4, 4, 16), torch.randn(6, 2, 16)
    with pytest.raises(KernelInputError, match="must not decrease"):
        ragged.ragged_attention(q, k, k, torch.tensor([0, 3, 2]), torch.tensor([0, 3, 6]))
    with pytest.raises(KernelInputError, match="more queries than keys"):
        ragged.ragged_attention(q, k, k, torch.tensor([0, 4]), torch.tensor([0, 3]))
    with pytest.raises(KernelInputError, match="past the 6 packed tokens"):
        ragged.ragged_attention(q, k, k, torch.tensor([0, 1]), torch.tensor([0, 7]))


def test_a_zero_block_is_refused_not_taken_for_the_default(ragged):
    q, k = torch.randn(4, 4, 16), torch.randn(6, 2, 16)
    cu_q, cu_k = torch.tensor([0, 4]), torch.tensor([0, 6])
    with pytest.raises(NoImplementationError, match=r"blocks must be positive, got block_q=0"):
        ragged.ragged_attention(q, k, k, cu_q, cu_k, implementation="pallas", block_q=0)


def test_page_size_the_tpu_kernel_cannot_tile(ragged):
    problem = ragged.jax.pallas_paged.blocks_problem(
        (8, 32, 128),
        (64, 12, 8, 128),
        "bfloat16",
        ragged.jax.pallas_paged.PagedBlocks(2),
        interpret=False,
    )
    assert problem and "page_size=12 cannot be tiled" in problem and "multiple of 16" in problem


def test_schemas_keep_their_positions(ragged):
    """The op schemas derived from ``RaggedSpec`` are those of 1.0 (positional calls keep their
    meaning): the tensors, then each op's options in the dataclass's order, then (1.1) the
    8-bit K/V's scales."""
    ops = ragged
    names = {
        op: [a.name for a in getattr(ops, op).op._schema.arguments]
        for op in ("ragged_attention_op", "paged_attention_op")
    }
    common = ["sliding_window", "softcap", "scale", "implementation"]
    assert names["ragged_attention_op"] == [
        "query", "key", "value", "cu_seq_lens_q", "cu_seq_lens_k", "sinks", "causal", *common,
        "block_q", "block_k", "k_scales", "v_scales",  # 1.1: 8-bit K/V's scales, last
    ]  # fmt: skip
    assert names["paged_attention_op"] == [
        "query", "k_pages", "v_pages", "block_table", "kv_lens", "sinks", *common,
        "pages_per_block", "k_scales", "v_scales",  # 1.1: the 8-bit cache's scales, last
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ({"sliding_window": 0}, "ragged-attention: sliding_window=0; it must be an integer >= 1"),
        ({"softcap": -1.0}, "ragged-attention: softcap=-1.0; it must be a finite number > 0"),
        ({"scale": float("inf")}, "ragged-attention: scale=inf; it must be finite or None"),
    ],
)
def test_bad_option_values(ragged, no_kernel_runs, option, message):
    q, k, v, table, lens = _paged_inputs()
    with pytest.raises(KernelInputError, match=re.escape(message)):
        ragged.paged_attention(q, k, v, table, lens, **option)
    cu = torch.tensor([0, 2], dtype=torch.int32)
    with pytest.raises(KernelInputError, match=re.escape(message)):
        ragged.ragged_attention(q[:2], k[0, :2], v[0, :2], cu, cu, **option)


def test_the_jax_functions_and_raw_ops_check_readable_values_too(ragged, no_kernel_runs):
    """The entry points' value checks (offsets, block tables) run in the JAX functions and the
    raw torch ops as well, wherever the values are on the host."""
    import numpy as np

    q, k, v, table, lens = _paged_inputs()
    table[1, 2] = 6
    message = r"block_table\[1, 2\] = 6 points past the cache"
    with pytest.raises(KernelInputError, match=message):
        ragged.jax.paged_attention(*(np.asarray(t) for t in (q, k, v, table, lens)))
    with pytest.raises(KernelInputError, match=message):
        ragged.paged_attention_op(q, k, v, table, lens)
    query, key = torch.randn(6, 4, 16), torch.randn(6, 2, 16)
    cu_q, cu_k = (
        torch.tensor([0, 4, 6], dtype=torch.int32),
        torch.tensor([0, 2, 6], dtype=torch.int32),
    )
    message = r"causal sequence 0 has more queries than keys"
    with pytest.raises(KernelInputError, match=message):
        ragged.jax.ragged_attention(*(np.asarray(t) for t in (query, key, key, cu_q, cu_k)))
    with pytest.raises(KernelInputError, match=message):
        ragged.ragged_attention_op(query, key, key, cu_q, cu_k)
