"""Read a TPU compiler's out-of-memory message: which memory (HBM or VMEM), the bytes the program
asked for and the bytes the chip has, so a compile failure says what overflowed by how much.

libtpu words them three ways (measured with libtpu 0.0.42):

* ``Ran out of memory on HBM, the total memory required for HLO temporaries (32.00G) exceeds
  available HBM (15.75G).``
* ``Ran out of memory in memory space vmem. Used 198.03M of 128.00M vmem.`` (v5e, v6e)
* ``Allocation (size=67108864) would exceed memory (size=16777216) :: ... space=vmem`` (v4)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_SIZE = r"([\d.]+)\s*([KMGT]?)i?B?"
_HBM = re.compile(rf"memory on HBM.*?\({_SIZE}\).*?available HBM \({_SIZE}\)", re.I | re.S)
_SPACE = re.compile(rf"memory in memory space (\w+)\.\s*Used {_SIZE} of {_SIZE}", re.I)
_ALLOCATION = re.compile(
    r"Allocation \(size=(\d+)\) would exceed memory \(size=(\d+)\).*?space=(\w+)", re.S
)


@dataclass(frozen=True)
class MemoryOverflow:
    """A program that does not fit a memory of the chip."""

    space: str
    """'HBM' or 'VMEM' (as the compiler names it, upper case)."""
    asked: int
    """Bytes the program needs there (the whole requirement; v4 reports one allocation)."""
    available: int

    def sizes(self, digits: int = 1) -> str:
        """Needed > available, e.g. ``18.22 GiB > 15.75 GiB`` at libtpu's two digits (one can
        print a need that barely overflows as equal to the chip's HBM)."""
        return f"{_human(self.asked, digits)} > {_human(self.available, digits)}"

    def __str__(self) -> str:
        return f"{self.space} {self.sizes()}"


def _bytes(number: str, unit: str) -> int:
    return round(float(number) * _UNITS[unit.upper()])


def _human(size: int, digits: int = 1) -> str:
    for unit in ("T", "G", "M", "K"):
        if size >= _UNITS[unit]:
            return f"{size / _UNITS[unit]:.{digits}f} {unit}iB"
    return f"{size} B"


def memory_overflow(message: str) -> MemoryOverflow | None:
    """The overflow a compiler message reports, or None for any other failure."""
    if match := _HBM.search(message):
        return MemoryOverflow("HBM", _bytes(*match.group(1, 2)), _bytes(*match.group(3, 4)))
    if match := _SPACE.search(message):
        space = match.group(1).upper()
        return MemoryOverflow(space, _bytes(*match.group(2, 3)), _bytes(*match.group(4, 5)))
    if match := _ALLOCATION.search(message):
        return MemoryOverflow(match.group(3).upper(), int(match.group(1)), int(match.group(2)))
    return None
