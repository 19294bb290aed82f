"""Implementation tables: each op has several implementations (pallas, tokamax, xla), tried in a
per-platform order; one that cannot take the inputs says why, and the next one runs.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import NoImplementationError, UnknownNameError
from .platform import Platform, jax_platform

log = logging.getLogger(__name__)

SupportCheck = Callable[..., "str | None"]

_order_generation = 0
_order_watchers: weakref.WeakSet = weakref.WeakSet()


def order_generation() -> int:
    """Bumped whenever the order of a table that has chosen an implementation by its order
    changes: traced and compiled kernels depend on it. A table nothing has consulted yet (a
    kernel just loaded, its order being set from the registry) cannot have shaped any program,
    so setting its order invalidates nothing."""
    return _order_generation


def watch_order(watcher: Any) -> None:
    """Call ``watcher.order_changed()`` whenever ``order_generation`` is bumped, for as long as
    the watcher lives (a cache that would otherwise check ``order_generation`` on every call)."""
    _order_watchers.add(watcher)


@dataclass(frozen=True)
class Implementation:
    """One way to compute an op. ``supports`` returns why it cannot take the inputs, or None."""

    name: str
    fn: Callable[..., Any]
    platforms: tuple[Platform, ...]
    supports: SupportCheck | None = None

    def rejection(self, platform: Platform, *args: Any, **kwargs: Any) -> str | None:
        if platform not in self.platforms:
            return f"runs on {', '.join(self.platforms)}, not {platform}"
        return self.supports(*args, **kwargs) if self.supports is not None else None


class ImplementationTable:
    """The implementations of one op and the order they are tried in on each platform."""

    def __init__(
        self,
        op: str,
        implementations: Sequence[Implementation],
        default_order: Mapping[Platform, Sequence[str]],
    ):
        self.op = op
        self.implementations = {impl.name: impl for impl in implementations}
        self._order: dict[Platform, tuple[str, ...]] = {}
        # set (never cleared) the first time a selection goes by the order: from then on a
        # program may depend on it, and each change of the order bumps ``order_generation``
        self._consulted = False
        for platform, names in default_order.items():
            self.set_order(platform, names)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.implementations)

    def order(self, platform: Platform) -> tuple[str, ...]:
        return self._order.get(platform, ())

    def set_order(self, platform: Platform, names: Sequence[str]) -> None:
        """Preferred order on a platform (the registry sets it when the kernel is loaded).

        Invalidates the compiled programs (``order_generation``) only when the order changes
        and some selection has gone by this table's order before: the flag is set before the
        order is read (``explain``) and read after the order is written here, so a trace
        either sees the new order or its program is invalidated."""
        global _order_generation
        for name in names:
            if name not in self.implementations:
                raise UnknownNameError(f"implementation of {self.op}", name, self.implementations)
        if self._order.get(platform) != tuple(names):
            self._order[platform] = tuple(names)
            if not self._consulted:
                return
            _order_generation += 1
            for watcher in list(_order_watchers):
                watcher.order_changed()

    def explain(
        self,
        *args: Any,
        implementation: str | None = None,
        platform: Platform | None = None,
        **kwargs: Any,
    ) -> list[tuple[str, str | None]]:
        """(name, reason it was skipped or None) for each candidate, in the order tried."""
        platform = platform or jax_platform()
        if implementation is not None:
            if implementation not in self.implementations:
                raise UnknownNameError(
                    f"implementation of {self.op}", implementation, self.implementations
                )
            candidates: tuple[str, ...] = (implementation,)
        else:
            self._consulted = True  # before reading the order: see ``set_order``
            candidates = self.order(platform)
        return [
            (name, self.implementations[name].rejection(platform, *args, **kwargs))
            for name in candidates
        ]

    def select(
        self,
        *args: Any,
        implementation: str | None = None,
        platform: Platform | None = None,
        **kwargs: Any,
    ) -> Implementation:
        """First implementation that accepts the inputs; a clear error when none does."""
        platform = platform or jax_platform()
        verdicts = self.explain(*args, implementation=implementation, platform=platform, **kwargs)
        for position, (name, reason) in enumerate(verdicts):
            if reason is None:
                for skipped, why in verdicts[:position]:
                    log.info("%s: skipped %s on %s: %s", self.op, skipped, platform, why)
                return self.implementations[name]
        reasons = "; ".join(f"{name}: {why}" for name, why in verdicts) or (
            f"no implementation is listed for {platform}"
        )
        raise NoImplementationError(
            f"{self.op}: nothing can run these inputs on {platform} ({reasons})"
        )

    def __call__(self, *args: Any, implementation: str | None = None, **kwargs: Any) -> Any:
        impl = self.select(*args, implementation=implementation, **kwargs)
        return impl.fn(*args, **kwargs)


PALLAS_FIRST_ON_TPU: Mapping[Platform, tuple[str, ...]] = {
    "tpu": ("pallas", "xla"),
    "gpu": ("xla",),
    "cpu": ("xla", "pallas"),
}
"""The order of a kernel with a Pallas kernel and an XLA path: the kernel first on TPU; on CPU it
runs in interpret mode (for tests), so XLA goes first there."""


def pallas_and_xla(
    op: str, pallas: Callable[..., Any], xla: Callable[..., Any], pallas_problem: SupportCheck
) -> ImplementationTable:
    """The table of an op with a Pallas kernel (TPU, and CPU in interpret mode) and an XLA path
    (every platform), in the ``PALLAS_FIRST_ON_TPU`` order."""
    return ImplementationTable(
        op,
        [
            Implementation("pallas", pallas, ("tpu", "cpu"), pallas_problem),
            Implementation("xla", xla, ("tpu", "gpu", "cpu")),
        ],
        default_order=PALLAS_FIRST_ON_TPU,
    )


def float64_problem(*arrays: Any) -> str | None:
    """Why a Pallas kernel cannot take these arrays here: Mosaic has no float64, which runs only
    in interpret mode (the CPU)."""
    if any(str(a.dtype) == "float64" for a in arrays) and jax_platform() != "cpu":
        return "float64 runs only in interpret mode"
    return None
