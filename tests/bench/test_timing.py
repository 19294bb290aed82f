"""Adaptive timing: stopping rules and robust statistics."""

import numpy as np
import pytest

from kernel_hub.bench import timing
from kernel_hub.bench.timing import Timing, TimingPolicy, measure, percentile
from kernel_hub.errors import KernelInputError


class FakeClock:
    """perf_counter stand-in: each timed call advances it by the next of ``durations``."""

    def __init__(self, durations):
        self.now = 0.0
        self.durations = iter(durations)

    def perf_counter(self):
        return self.now

    def call(self):
        self.now += next(self.durations)


def test_percentiles_match_numpy():
    samples = np.random.default_rng(1).lognormal(size=101).tolist()
    for q in (0, 10, 25, 50, 75, 90, 100):
        assert percentile(samples, q) == pytest.approx(np.percentile(samples, q))
    summary = Timing(tuple(samples))
    assert summary.median == pytest.approx(np.median(samples))
    assert summary.iqr == pytest.approx(np.subtract(*np.percentile(samples, [75, 25])))


def test_identical_samples_stop_once_the_median_is_known(monkeypatch):
    clock = FakeClock([1.0] * 1000)
    monkeypatch.setattr(timing.time, "perf_counter", clock.perf_counter)
    result = measure(clock.call, TimingPolicy(budget_s=1e9, min_samples=5))
    # zero spread: the precision test passes at its first check, after 20 samples
    assert len(result.samples) == 20
    assert result.median == 1.0


def test_noisy_samples_run_until_the_budget(monkeypatch):
    durations = np.random.default_rng(0).uniform(0.5, 1.5, size=1000).tolist()
    clock = FakeClock(durations)
    monkeypatch.setattr(timing.time, "perf_counter", clock.perf_counter)
    result = measure(clock.call, TimingPolicy(budget_s=30.0, min_samples=5, rel_precision=1e-6))
    assert sum(result.samples) >= 30.0
    assert sum(result.samples[:-1]) < 30.0


def test_min_samples_beat_the_budget(monkeypatch):
    clock = FakeClock([10.0] * 100)
    monkeypatch.setattr(timing.time, "perf_counter", clock.perf_counter)
    assert len(measure(clock.call, TimingPolicy(budget_s=1.0, min_samples=7)).samples) == 7


@pytest.mark.parametrize(
    "kwargs", [{"budget_s": 0}, {"min_samples": 0}, {"min_samples": 10, "max_samples": 5}]
)
def test_bad_policy_is_refused(kwargs):
    with pytest.raises(KernelInputError):
        TimingPolicy(**kwargs)
