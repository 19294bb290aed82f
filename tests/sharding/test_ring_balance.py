"""Ring attention's per-shard work, counted without devices: the kernel block computations each
shard does over the whole ring, from the ring's own schedule and the kernel's causal block
skipping (``ring.block_counts``), and read from the compiled program (deviceless TPU): the
kernel launches of every branch a chip may take at each step. Zig-zag evens a causal ring out;
contiguous chunks do not; a sliding window runs only the steps it reaches."""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np
import pytest

from kernel_hub import get_kernel
from kernel_hub.bench.mesh_compile import compiled_hlo, count_collectives

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


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_a_window_covering_the_sequence_counts_as_causal(layout: str) -> None:
    """The windowed ring's count (token positions: the kernel's skipping on their block ranges)
    agrees with the causal ring's (the index rule) when the window hides nothing."""
    options = dict(causal=True, layout=layout, block_q=128, block_k=128, shards=4)
    assert RING.block_counts(4096, sliding_window=4096, **options) == RING.block_counts(
        4096, **options
    )


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_a_window_under_a_chunk_runs_two_steps_and_balances(layout: str) -> None:
    """A causal window of 256 over 1024-token chunks: the blocks travel one hop (contiguous; zig-
    zag also from the shard after it), the other steps are never run, and every shard but the
    first (whose first chunk has no earlier one) does the same work."""
    steps = RING.window_steps(1024, 4, layout, causal=True, window=256)
    assert steps == ([0, 1] if layout == "contiguous" else [0, 1, 3])
    counts = RING.block_counts(
        4096, causal=True, layout=layout, block_q=128, block_k=128, shards=4, sliding_window=256
    )
    assert len(set(counts[1:])) == 1 and counts[0] < counts[1], counts
    assert (
        sum(counts)
        < sum(
            RING.block_counts(4096, causal=True, layout=layout, block_q=128, block_k=128, shards=4)
        )
        / 4
    )


def test_window_meets_reads_the_rule() -> None:
    meets = RING.window_meets
    assert meets((100, 199), (0, 99), causal=True, window=2)  # 100 sees 99
    assert not meets((100, 199), (0, 98), causal=True, window=2)
    assert not meets((0, 99), (100, 199), causal=True, window=1000)  # the future
    assert meets((0, 99), (100, 199), causal=False, window=2)  # 99 sees 100 both ways
    assert not meets((0, 99), (101, 199), causal=False, window=2)


# --- from the compiled program (deviceless v5e:2x2, 4 chips) ------------------------------------
# The program is the same on every chip; what differs is which branch of each ring step's
# ``conditional`` a chip takes (chosen from its partition id). So a chip's work is the kernel
# launches outside conditionals (the same on all) plus one branch per conditional: when every
# branch of every conditional launches the same work, every chip does the same work.

_HEADER = re.compile(r"^(?:ENTRY )?%([\w.\-]+) \(.*\{$")
_LAUNCH = re.compile(
    r'custom_call_target="tpu_custom_call", operand_layout_constraints='
    r"\{((?:\w+\[[\d,]*\]\{[\d,]*\}(?:, )?)+)\}"
)
_OPERAND = re.compile(r"\w+\[([\d,]*)\]")
_CONDITIONAL = re.compile(r" conditional\(.*branch_computations=\{([^}]*)\}")


def _computations(hlo: str) -> dict[str, list[str]]:
    found, name = {}, None
    for line in hlo.splitlines():
        header = _HEADER.match(line)
        if header:
            name = header.group(1)
            found[name] = []
        elif line == "}":
            name = None
        elif name is not None:
            found[name].append(line)
    return found


def _launch_work(lines: list[str]) -> int:
    """Query rows x keys over the attention kernel launches in ``lines`` (q [.., Sq, D], k
    [.., Sk, D]: the work of an unmasked call)."""
    total = 0
    for line in lines:
        for operands in _LAUNCH.findall(line):
            # q and k are the first operands of rank >= 3 (the 1-D block ranges the kernel takes
            # as scalar prefetch with positions come before them)
            shapes = [[int(d) for d in dims.split(",")] for dims in _OPERAND.findall(operands)]
            q_dims, k_dims = [dims for dims in shapes if len(dims) >= 3][:2]
            total += math.prod(q_dims[:-1]) * k_dims[-2]
    return total


def _branch_work(hlo: str) -> list[list[int]]:
    """Per conditional of the compiled program, the launch work of each branch."""
    computations = _computations(hlo)
    return [
        [_launch_work(computations[name.strip().lstrip("%")]) for name in names.split(",")]
        for names in _CONDITIONAL.findall(hlo)
    ]


def _ring_case(name: str, **options):
    import jax
    import jax.numpy as jnp

    from kernel_hub.sharding import MeshCase

    q = jax.ShapeDtypeStruct((1, 8, 2048, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 2, 2048, 128), jnp.bfloat16)
    cp = (None, None, "cp", None)
    fn = lambda q, k, v: RING.ring_attention(q, k, v, causal=True, **options)
    return MeshCase(name, fn, (q, kv, kv), (cp, cp, cp), ("cp",))


@pytest.mark.slow
@pytest.mark.tpu_compile
@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_compiled_zigzag_ring_gives_every_chip_equal_work(direction: str) -> None:
    case = dataclasses.replace(_ring_case("zig-zag", layout="zigzag"), differentiable=(0, 1, 2))
    zigzag = _branch_work(compiled_hlo(case, "v5e", direction))
    # steps 1..3 of 4 chips (step 0: the same causal call on all), the backward's twice
    assert len(zigzag) == {"forward": 3, "backward": 6}[direction], zigzag
    assert all(len(set(w)) == 1 and w[0] > 0 for w in zigzag), zigzag
    if direction == "forward":  # the check can fail: a contiguous causal ring's chips skip a step
        contiguous = _branch_work(compiled_hlo(_ring_case("contiguous"), "v5e", "forward"))
        assert contiguous and all(min(w) == 0 < max(w) for w in contiguous), contiguous


@pytest.mark.slow
@pytest.mark.tpu_compile
def test_compiled_windowed_ring_runs_only_the_steps_inside_the_window() -> None:
    """Causal window 256 over 512-token chunks: one hop of k and v (2 collective-permutes, the
    plain ring has 6) and two kernel launches (the diagonal, the previous chunk's)."""
    hlo = compiled_hlo(_ring_case("window", sliding_window=256), "v5e", "forward")
    counts = count_collectives(hlo)
    assert counts.get("collective-permute") == 2 and counts["mosaic"] == 2, counts
    assert [len(w) for w in _branch_work(hlo)] == [2], "one step decided per chip"
