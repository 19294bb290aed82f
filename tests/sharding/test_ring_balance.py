"""Ring attention's per-shard work, counted without devices: the kernel block computations each
shard does over the whole ring, from the ring's own schedule and the kernel's causal block
skipping (``ring.block_counts``). Zig-zag evens a causal ring out; contiguous chunks do not."""

from __future__ import annotations

import numpy as np
import pytest

from kernel_hub import get_kernel

RING = get_kernel("attention").ring


@pytest.mark.parametrize("shards", [4, 8])
def test_zigzag_causal_ring_is_balanced(shards: int) -> None:
    counts = RING.block_counts(
        4096, causal=True, layout="zigzag", block_q=128, block_k=128, shards=shards
    )
    assert max(counts) - min(counts) <= 1, counts
    contiguous = RING.block_counts(
        4096, causal=True, layout="contiguous", block_q=128, block_k=128, shards=shards
    )
    # the contiguous ring's last shard does ~2 x shards times its first shard's work ...
    assert max(contiguous) >= shards * min(contiguous), contiguous
    # ... for the same total: balancing moves work, it adds none beyond the split diagonal
    assert sum(counts) <= sum(contiguous) * 1.05


def test_bidirectional_rings_are_balanced_either_way() -> None:
    for layout in RING.LAYOUTS:
        counts = RING.block_counts(
            2048, causal=False, layout=layout, block_q=128, block_k=128, shards=4
        )
        assert len(set(counts)) == 1


def test_zigzag_order_lays_out_chunk_pairs() -> None:
    order = RING.zigzag_order(16, 4)
    assert order.reshape(4, 4).tolist() == [
        [0, 1, 14, 15],
        [2, 3, 12, 13],
        [4, 5, 10, 11],
        [6, 7, 8, 9],
    ]
    assert np.array_equal(np.sort(order), np.arange(16))
    with pytest.raises(ValueError, match="divide by 8"):
        RING.zigzag_order(20, 4)
