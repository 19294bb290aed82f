"""A hub that stalls, dribbles, rate-limits for a month, pages forever or sends a gzip bomb: each
ends in a ``HubError`` naming the limit and the variable that changes it, within seconds (the
limits are set small here), with nothing left in staging; a fetcher waiting on the lock gets it
back; and 64 clients under random faults all end with the genuine build or a clear error."""

from __future__ import annotations

import gzip
import logging
import random
import threading
import time
import tracemalloc

import pytest

from kernel_hub.errors import HubError, KernelHubError
from kernel_hub.hub import fetch as hub_fetch
from kernel_hub.loading.resolver import fetch_op_build, get_kernel
from kernel_hub.platform import host_platform
from kernel_hub.registry.registry import load_registry

from .hub_helpers import cache_dir
from .hub_server import Fault

FILE_RE = r"/resolve/.*/build/torch-cpu/rmsnorm/api\.py$"


@pytest.fixture
def limits(monkeypatch):
    """Small limits, so that each case takes seconds; JAX's first platform query (seconds, before
    any request) is made first, so that the cases time only the fetch."""
    host_platform()

    def set_limits(**values: float) -> None:
        for name, value in values.items():
            monkeypatch.setenv(name, str(value))

    set_limits(
        HF_HUB_DOWNLOAD_TIMEOUT=1,
        HF_HUB_ETAG_TIMEOUT=1,
        KERNEL_HUB_FETCH_DEADLINE=20,
        KERNEL_HUB_RETRY_TIME=5,
    )
    return set_limits


def fetch(version: str = "1.1.0"):
    registry = load_registry()
    entry = registry.get("rmsnorm")
    return fetch_op_build(entry, version=version, keys=registry.keys_for(entry.repo))


def timed_failure(match: str, seconds: float) -> HubError:
    started = time.monotonic()
    with pytest.raises(HubError, match=match) as failure:
        fetch()
    assert time.monotonic() - started < seconds
    return failure.value


def assert_no_staging(tmp_path) -> None:
    assert not list(cache_dir(tmp_path).rglob(".staging*"))
    assert not list(cache_dir(tmp_path).rglob("*.incomplete"))


def test_a_stalled_body_ends_at_the_read_timeout_naming_it(publish, hub_env, limits, tmp_path):
    publish("1.1.0")
    limits(KERNEL_HUB_RETRY_TIME=0.5)  # no second try: the timeout itself is the error
    hub_env.inject_fault(Fault("GET", FILE_RE, delay=60))
    timed_failure(r"api\.py: no answer from .* within 1 s .*HF_HUB_DOWNLOAD_TIMEOUT", 10)
    assert_no_staging(tmp_path)


def test_a_stalled_listing_ends_at_the_api_timeout_naming_it(publish, hub_env, limits):
    publish("1.1.0")
    limits(KERNEL_HUB_RETRY_TIME=0.5)
    hub_env.inject_fault(Fault("GET", r"/refs$", delay=60))
    timed_failure(r"listing versions of .*within 1 s.*HF_HUB_ETAG_TIMEOUT", 10)


def test_a_dribbling_body_ends_at_the_fetch_deadline(publish, hub_env, limits, tmp_path):
    """A byte every 0.2 s never trips the read timeout; the deadline of the whole fetch ends it."""
    publish("1.1.0")
    limits(KERNEL_HUB_FETCH_DEADLINE=3)
    hub_env.inject_fault(Fault("GET", FILE_RE, delay=0.2))
    timed_failure(r"fetch deadline of 3 s \(set KERNEL_HUB_FETCH_DEADLINE", 8)
    assert_no_staging(tmp_path)


def test_a_month_of_retry_after_is_an_error_not_a_wait(publish, hub_env, limits):
    publish("1.1.0")
    hub_env.inject_fault(Fault("GET", FILE_RE, status=429, headers={"Retry-After": "2592000"}))
    timed_failure(r"Retry-After: 2592000 s, longer than the 30 s .*KERNEL_HUB_MAX_RETRY_AFTER", 5)


def test_retries_stop_at_the_total_retry_time(publish, hub_env, limits):
    publish("1.1.0")
    limits(KERNEL_HUB_RETRY_TIME=2)
    fault = hub_env.inject_fault(Fault("GET", FILE_RE, status=503))
    timed_failure(r"answered HTTP 503; retrying would wait past the retry time of 2 s", 6)
    assert fault.hits == 2  # waited 1 s, then the next wait (2 s) would pass the 2 s allowed


def test_endless_listing_pages_stop_at_the_page_cap(publish, hub_env, limits):
    publish("1.1.0")
    limits(KERNEL_HUB_MAX_PAGES=3)

    def next_page_forever(method, path, status, body, headers):
        if "/tree/" in path:
            headers["Link"] = f'<{hub_env.url}{path}?recursive=true&cursor=more>; rel="next"'
        return status, body, headers

    hub_env.lie = next_page_forever
    start = len(hub_env.requests)
    timed_failure(r"more than 3 pages \(set KERNEL_HUB_MAX_PAGES", 10)
    assert sum("/tree/" in p for _, p in hub_env.requests[start:]) == 3


def test_a_next_page_on_another_host_is_refused(publish, hub_env, limits):
    publish("1.1.0")

    def elsewhere(method, path, status, body, headers):
        if "/tree/" in path:
            headers["Link"] = '<http://169.254.169.254/latest/meta-data>; rel="next"'
        return status, body, headers

    hub_env.lie = elsewhere
    timed_failure(r"next listing page is on another host", 10)


def _gzip_lie(path_part: str, wire_for):
    """Answers to paths holding ``path_part`` sent as ``wire_for(honest body)``, declared gzip."""

    def lie(method, path, status, body, headers):
        if path_part in path:
            headers["Content-Encoding"] = "gzip"
            return status, wire_for(body), headers
        return status, body, headers

    return lie


def test_a_gzip_bomb_stops_at_the_decoded_size_cap_without_filling_memory(publish, hub_env, limits):
    publish("1.1.0")
    limits(KERNEL_HUB_MAX_API_BYTES=1024 * 1024)
    wire = gzip.compress(b"[" + b" " * (64 * 1024 * 1024) + b"]")  # 64 MiB decoded, 64 KiB sent
    hub_env.lie = _gzip_lie("/refs", lambda body: wire)
    tracemalloc.start()
    try:
        timed_failure(r"larger than 1048576 bytes \(set KERNEL_HUB_MAX_API_BYTES", 20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * 1024 * 1024  # the whole bomb would be 64 MiB, in memory at once


def test_an_honest_gzip_answer_is_decoded(publish, hub_env, limits):
    new = publish("1.1.0")
    hub_env.lie = _gzip_lie("/refs", gzip.compress)
    assert fetch().commit == new.commit


def test_a_waiter_gets_the_lock_back_when_the_holder_hits_its_deadline(
    publish, hub_env, limits, monkeypatch, tmp_path
):
    """The first fetcher stalls inside the variant lock until its 3 s deadline; a second one
    (started with a longer deadline) waits on the lock, then downloads the genuine build."""
    new = publish("1.1.0")
    limits(KERNEL_HUB_FETCH_DEADLINE=3, HF_HUB_DOWNLOAD_TIMEOUT=30)
    stall = hub_env.inject_fault(Fault("GET", FILE_RE, delay=60, times=1))
    outcome: dict[str, object] = {}

    def run(name: str) -> None:
        started = time.monotonic()
        try:
            outcome[name] = fetch().commit
        except KernelHubError as exc:
            outcome[name] = exc
        outcome[f"{name} seconds"] = time.monotonic() - started

    holder = threading.Thread(target=run, args=("holder",))
    holder.start()
    while stall.hits == 0 and holder.is_alive():
        time.sleep(0.02)
    monkeypatch.setenv("KERNEL_HUB_FETCH_DEADLINE", "60")
    waiter = threading.Thread(target=run, args=("waiter",))
    waiter.start()
    holder.join(30)
    waiter.join(30)
    assert isinstance(outcome["holder"], HubError), outcome
    assert "fetch deadline of 3 s" in str(outcome["holder"])
    assert outcome["waiter"] == new.commit
    assert outcome["waiter seconds"] < 20
    assert_no_staging(tmp_path)


def test_64_clients_under_random_stalls_drops_and_rate_limits(
    publish, hub_env, limits, monkeypatch, tmp_path
):
    """Every client ends within its deadline with the genuine build or a clear ``HubError``;
    afterwards nothing is left in staging and the build loads offline."""
    new = publish("1.1.0")
    limits(
        HF_HUB_DOWNLOAD_TIMEOUT=0.5,
        HF_HUB_ETAG_TIMEOUT=0.5,
        KERNEL_HUB_FETCH_DEADLINE=8,
        KERNEL_HUB_RETRY_TIME=3,
    )
    dice = random.Random(33)
    dice_lock = threading.Lock()

    def chaos(method, path):
        with dice_lock:
            roll = dice.random()
        if roll < 0.02:
            return Fault(method, "", delay=30)  # stalls past the read timeout
        if roll < 0.04 and "/resolve/" in path:
            return Fault(method, "", truncate_at=5)  # drops the connection mid-body
        if roll < 0.07:
            return Fault(method, "", status=429, headers={"Retry-After": "0"})
        if roll < 0.08:
            return Fault(method, "", status=429, headers={"Retry-After": "86400"})
        if roll < 0.10:
            return Fault(method, "", status=503)
        return None

    hub_env.chaos = chaos
    results: list[tuple[object, float]] = []
    barrier = threading.Barrier(64)

    def client() -> None:
        barrier.wait()
        started = time.monotonic()
        try:
            outcome: object = fetch().commit
        except KernelHubError as exc:
            outcome = exc
        results.append((outcome, time.monotonic() - started))

    threads = [threading.Thread(target=client) for _ in range(64)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not any(t.is_alive() for t in threads)
    hub_env.chaos = None
    assert len(results) == 64
    for outcome, seconds in results:
        assert seconds < 8 + 5, (outcome, seconds)  # the deadline, plus verifying under load
        assert outcome == new.commit or isinstance(outcome, HubError), outcome
    genuine = sum(outcome == new.commit for outcome, _ in results)
    errors = [str(o) for o, _ in results if isinstance(o, HubError)]
    reasons = ("HTTP", "no answer", "cannot reach", "deadline", "Retry-After", "retry time")
    assert all(any(reason in e for reason in reasons) for e in errors), errors
    assert genuine > 0, errors
    assert_no_staging(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert get_kernel("rmsnorm", version="1.1.0").origin.commit == new.commit


def test_with_the_hub_unreachable_a_cached_build_loads_and_says_so_once(
    publish, hub_env, limits, monkeypatch, caplog
):
    """HF_HUB_OFFLINE unset and no connection: the cached build is verified and loaded, as
    huggingface_hub and Transformers fall back to their cache; a build never cached is the error."""
    good = publish("1.0.0")
    publish("1.1.0")
    assert fetch("1.0.0").commit == good.commit
    limits(KERNEL_HUB_RETRY_TIME=0.5)
    monkeypatch.setattr(hub_fetch, "_said_unreachable", set())
    hub_env.stop()
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            assert get_kernel("rmsnorm", version="1.0.0").origin.commit == good.commit
    said = [r.getMessage() for r in caplog.records if "loading cached builds" in r.getMessage()]
    assert len(said) == 1 and "cannot reach the hub" in said[0], said
    with pytest.raises(HubError, match="cannot reach the hub"):
        fetch("1.1.0")
