"""What ``kernelize`` did: every candidate module, what it got, or why it kept its own forward."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class ReportEntry:
    """One candidate module."""

    module: str
    """Qualified name in the model (``""`` for the model itself)."""
    cls: str
    kind: str
    """``layer`` (forward swapped) or a Transformers interface kind (``attention``, ``experts``)."""
    target: str
    """Layer name (``RMSNorm``) or interface (``AttentionInterface``) it is a candidate for."""
    found_by: str
    """How it was found: ``use_kernel_forward``/``kernel_layer_name``, ``mark_layer``,
    ``recognised`` (known Transformers class) or the interface it dispatches through."""
    op: str | None = None
    swapped_to: str | None = None
    reason: str | None = None
    """Why the module was left alone (None when swapped)."""

    @property
    def swapped(self) -> bool:
        return self.swapped_to is not None

    def line(self) -> str:
        outcome = f"-> {self.swapped_to}" if self.swapped else f"left alone: {self.reason}"
        return f"{self.module or '<model>'} ({self.cls}, {self.target}): {outcome}"


@dataclass(frozen=True)
class KernelizeReport:
    model: str
    mode: str
    device: str
    entries: tuple[ReportEntry, ...]
    origins: Mapping[str, str] = field(default_factory=dict)
    """Op -> where the kernel that swapped its modules came from (``in-tree``, ``local`` or
    ``hub``: its ``origin.source``)."""

    @property
    def swapped(self) -> tuple[ReportEntry, ...]:
        return tuple(e for e in self.entries if e.swapped)

    @property
    def left_alone(self) -> tuple[ReportEntry, ...]:
        return tuple(e for e in self.entries if not e.swapped)

    def counts(self) -> dict[str, int]:
        """Swapped modules per target, e.g. ``{"RMSNorm": 5, "AttentionInterface": 2}``."""
        return dict(Counter(e.target for e in self.swapped))

    def summary(self) -> str:
        head = f"kernelize {self.model} (mode {self.mode}, device {self.device})"
        if not self.entries:
            return f"{head}: no replaceable layers found; the model is unchanged"
        return f"{head}: {len(self.swapped)} swapped, {len(self.left_alone)} left alone"

    def __str__(self) -> str:
        return "\n".join([self.summary(), *(f"  {e.line()}" for e in self.entries)])

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "mode": self.mode,
            "device": self.device,
            "summary": self.summary(),
            "entries": [asdict(e) for e in self.entries],
            "origins": dict(self.origins),
        }
