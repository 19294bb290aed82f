"""Adaptive wall-clock timing of a synchronised call: median and spread on a noisy machine.

Each sample times one call including its synchronisation (``block_until_ready`` or a device sync,
done by the caller's ``fn``). Sampling stops at the first of:

- ``max_samples`` samples;
- the median is known to ``rel_precision``: its standard error, estimated from the IQR as
  ``0.93 * IQR / sqrt(n)`` (1.253 sigma / sqrt(n) for a median, sigma ~ IQR / 1.349), is below
  ``rel_precision * median`` (checked from 20 samples on);
- ``budget_s`` of sampling has passed and ``min_samples`` are in.

The robust statistics (median, percentiles, IQR) keep a few preempted samples from moving the
result, which a mean would not.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kernel_hub.errors import KernelInputError

_PRECISION_MIN_SAMPLES = 20


@dataclass(frozen=True)
class TimingPolicy:
    """When to stop sampling; see the module docstring."""

    budget_s: float = 1.0
    min_samples: int = 5
    max_samples: int = 1000
    rel_precision: float = 0.01

    def __post_init__(self) -> None:
        if self.budget_s <= 0:
            raise KernelInputError(f"timing budget must be > 0 seconds, got {self.budget_s}")
        if not 1 <= self.min_samples <= self.max_samples:
            raise KernelInputError(
                f"need 1 <= min_samples <= max_samples, got {self.min_samples} and "
                f"{self.max_samples}"
            )


DEFAULT_POLICY = TimingPolicy()


def percentile(samples: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile ``q`` in [0, 100] of a non-empty sequence."""
    ordered = sorted(samples)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass(frozen=True)
class Timing:
    """Samples in seconds and their robust summary."""

    samples: tuple[float, ...]

    @property
    def median(self) -> float:
        return percentile(self.samples, 50)

    @property
    def p10(self) -> float:
        return percentile(self.samples, 10)

    @property
    def p90(self) -> float:
        return percentile(self.samples, 90)

    @property
    def iqr(self) -> float:
        return percentile(self.samples, 75) - percentile(self.samples, 25)

    @property
    def median_rel_error(self) -> float:
        """Estimated standard error of the median over the median."""
        if self.median <= 0:
            return math.inf
        return 0.93 * self.iqr / math.sqrt(len(self.samples)) / self.median


def measure(fn: Callable[[], object], policy: TimingPolicy = DEFAULT_POLICY) -> Timing:
    """Call ``fn`` repeatedly (no warm-up here: do that first) and time each call."""
    samples: list[float] = []
    # The precision test needs enough samples for a meaningful IQR, and sorts: run it from
    # _PRECISION_MIN_SAMPLES on, at growing intervals.
    next_check = max(policy.min_samples, _PRECISION_MIN_SAMPLES)
    started = time.perf_counter()
    while len(samples) < policy.max_samples:
        begin = time.perf_counter()
        fn()
        samples.append(round(time.perf_counter() - begin, 9))  # the clock's ns resolution
        if len(samples) < policy.min_samples:
            continue
        if time.perf_counter() - started >= policy.budget_s:
            break
        if len(samples) >= next_check:
            if Timing(tuple(samples)).median_rel_error < policy.rel_precision:
                break
            next_check = math.ceil(len(samples) * 1.1)
    return Timing(tuple(samples))
