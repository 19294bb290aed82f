"""Compiler out-of-memory messages read as the memory that overflowed, with the bytes asked and
available; the messages are libtpu 0.0.42's, captured from deviceless compiles."""

from __future__ import annotations

import pytest

from kernel_hub.bench.overflow import MemoryOverflow, memory_overflow
from kernel_hub.bench.report import compile_cell

HBM = (
    "JaxRuntimeError: RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required "
    "for HLO temporaries (32.00G) exceeds available HBM (15.75G)."
)
VMEM_V5E = (
    "JaxRuntimeError: RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in "
    "memory space vmem. Used 198.03M of 128.00M vmem. Exceeded vmem capacity by 70.03M."
)
VMEM_V4 = (
    "JaxRuntimeError: RESOURCE_EXHAUSTED: Allocation (size=67108864) would exceed memory "
    "(size=16777216) :: #allocation2 [shape = 'u8[67108864]{0}', space=vmem, size = 0x4000000, "
    "scoped, tag = 'input window allocation for operator input 0."
)


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        (HBM, MemoryOverflow("HBM", 32 * 2**30, round(15.75 * 2**30))),
        (VMEM_V5E, MemoryOverflow("VMEM", round(198.03 * 2**20), 128 * 2**20)),
        (VMEM_V4, MemoryOverflow("VMEM", 67108864, 16777216)),
        ("Mosaic failed to compile TPU kernel: unsupported block shape", None),
    ],
)
def test_overflow_messages(message: str, expected: MemoryOverflow | None) -> None:
    assert memory_overflow(message) == expected


def test_labels_name_the_memory_and_sizes() -> None:
    fail = {"status": "fail", "seconds": 1.0, "vmem_overflow": False}
    hbm = {**fail, "overflow": {"space": "HBM", "asked": 32 * 2**30, "available": 15 * 2**30}}
    assert compile_cell(hbm) == "FAIL (HBM 32.0 GiB > 15.0 GiB)"
    vmem = {**fail, "overflow": {"space": "VMEM", "asked": 198 * 2**20, "available": 2**27}}
    assert compile_cell(vmem) == "FAIL (VMEM 198.0 MiB > 128.0 MiB)"
    assert compile_cell(fail) == "FAIL"
