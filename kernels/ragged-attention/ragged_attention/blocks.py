"""Block sizes of the two kernels: defaults per shape, and a per-generation table kept as data.

The table holds block sizes that compiled for that generation at the benchmark's decode shapes
(deviceless Mosaic compiles, ``benchmarks/serving.py``); they are not timed on a TPU. A lookup
never raises: a generation or dtype that is not in the table (a CPU, a new chip) gets the
shape-based default, and interpret mode (CPU) takes few, large blocks.
"""

from __future__ import annotations

from .pallas_paged import PagedBlocks
from .pallas_ragged import RaggedBlocks

_INTERPRET_BLOCK = 2048
# Keys one paged grid step should cover: enough to amortise the per-step cost.
_PAGED_TOKENS_PER_STEP = 512

RAGGED_TABLE: dict[tuple[str, str], RaggedBlocks] = {
    ("v5e", "bfloat16"): RaggedBlocks(q=128, k=512),
    ("v6e", "bfloat16"): RaggedBlocks(q=256, k=1024),
    ("v5e", "float32"): RaggedBlocks(q=128, k=512),
    ("v6e", "float32"): RaggedBlocks(q=128, k=1024),
}
_RAGGED_DEFAULT = RaggedBlocks(q=128, k=512)


def ragged_blocks(generation: str | None, dtype: str, *, interpret: bool) -> RaggedBlocks:
    if interpret:
        return RaggedBlocks(_INTERPRET_BLOCK, _INTERPRET_BLOCK)
    return RAGGED_TABLE.get((generation or "", dtype), _RAGGED_DEFAULT)


def paged_blocks(page_size: int, max_pages: int, *, interpret: bool) -> PagedBlocks:
    """One step over all of a sequence's pages in interpret mode; ~512 keys a step on TPU."""
    if interpret:
        return PagedBlocks(max(1, max_pages))
    return PagedBlocks(max(1, min(max_pages, _PAGED_TOKENS_PER_STEP // max(1, page_size))))
