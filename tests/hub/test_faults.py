"""A hub that fails, a disk that fills, fetchers racing, a cache changed behind kernel-hub's back:
each ends in a clear error or a verified build, and never in half-written files in the cache."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from kernel_hub.errors import HubError, IntegrityError, KernelHubError
from kernel_hub.hub.build import build_kernel
from kernel_hub.hub.signing import signature_path
from kernel_hub.loading.resolver import get_kernel

from .hub_helpers import GAVE_UP_WAITS, REPO, cache_dir
from .hub_server import Fault

FILE_RE = r"/resolve/.*/build/torch-cpu/rmsnorm/api\.py$"


def repo_cache(tmp_path):
    return cache_dir(tmp_path) / "kernels--kernel-hub--rmsnorm"


def assert_nothing_half_written(tmp_path, commit: str) -> None:
    """No variant folder, no signature, no partial download anywhere in the repo's cache."""
    snapshot = repo_cache(tmp_path) / "snapshots" / commit
    assert not (snapshot / "build" / "torch-cpu").exists()
    assert not (snapshot / signature_path("torch-cpu")).exists()
    assert not [p for p in repo_cache(tmp_path).rglob("*") if p.name.endswith(".incomplete")]
    assert not list(repo_cache(tmp_path).glob(".staging*"))


def test_server_dying_mid_download(publish, hub_env, tmp_path, retry_waits):
    new = publish("1.1.0")
    hub_env.inject_fault(Fault("GET", FILE_RE, truncate_at=100, die=True, times=1))
    with pytest.raises(HubError, match=r"op rmsnorm: downloading kernel-hub/rmsnorm v1\.1\.0"):
        get_kernel("rmsnorm", version="1.1.0")  # the client retries, then gives up
    assert retry_waits == GAVE_UP_WAITS
    assert hub_env.stopped.wait(10)
    assert_nothing_half_written(tmp_path, new.commit)
    hub_env.start()  # the server comes back on the same port
    assert get_kernel("rmsnorm", version="1.1.0").origin.commit == new.commit


def test_a_body_cut_short_once_is_fetched_again(publish, hub_env, tmp_path):
    new = publish("1.1.0")
    hub_env.inject_fault(Fault("GET", FILE_RE, truncate_at=100, times=1))
    assert get_kernel("rmsnorm", version="1.1.0").origin.commit == new.commit
    assert len(hub_env.downloads("rmsnorm/api.py")) == 2  # from the start, in the same staging


def test_rate_limit_is_retried_with_backoff(publish, hub_env):
    new = publish("1.1.0")
    hub_env.inject_fault(Fault("GET", FILE_RE, status=429, times=1, headers={"Retry-After": "0"}))
    started = time.monotonic()
    assert get_kernel("rmsnorm", version="1.1.0").origin.commit == new.commit
    assert time.monotonic() - started >= 1  # kernel-hub's 1 s backoff before the retry
    assert len(hub_env.downloads("rmsnorm/api.py")) == 2


def test_unavailable_listing_is_retried_with_backoff(publish, hub_env):
    new = publish("1.1.0")
    start = len(hub_env.requests)
    fault = hub_env.inject_fault(Fault("GET", r"/tree/", status=503, times=1))
    assert get_kernel("rmsnorm", version="1.1.0").origin.commit == new.commit
    paths = [p for m, p in hub_env.requests[start:]]
    first = next(p for p in paths if "/tree/" in p)  # answered 503, then asked again
    assert fault.hits == 1 and paths.count(first) >= 2


@pytest.mark.parametrize(
    ("method", "path", "status", "message"),
    [
        ("GET", r"/refs$", 429, r"listing versions of kernel-hub/rmsnorm: .*answered HTTP 429"),
        ("GET", FILE_RE, 500, r"downloading kernel-hub/rmsnorm v1\.1\.0: .*answered HTTP 500"),
    ],
)
def test_hub_errors_are_clear_and_leave_nothing(
    publish, hub_env, tmp_path, method, path, status, message, retry_waits
):
    new = publish("1.1.0")
    hub_env.inject_fault(Fault(method, path, status=status))
    with pytest.raises(HubError, match=message):
        get_kernel("rmsnorm", version="1.1.0")
    assert retry_waits == GAVE_UP_WAITS
    assert_nothing_half_written(tmp_path, new.commit)


def test_disk_full_while_writing_the_cache(publish, hub_env, tmp_path, monkeypatch):
    from kernel_hub.hub import transfer

    new = publish("1.1.0")
    real_stream = transfer._stream

    def fill_disk(repo, commit, path, limit, sink, where, **kwargs):
        def write_then_fail(chunk):
            sink(chunk[:10])  # half a file, then the disk is full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        full = path.endswith("rmsnorm/api.py")
        return real_stream(
            repo, commit, path, limit, write_then_fail if full else sink, where, **kwargs
        )

    monkeypatch.setattr(transfer, "_stream", fill_disk)
    with pytest.raises(HubError, match="No space left on device"):
        get_kernel("rmsnorm", version="1.1.0")
    assert_nothing_half_written(tmp_path, new.commit)
    monkeypatch.setattr(transfer, "_stream", real_stream)
    assert get_kernel("rmsnorm", version="1.1.0").origin.commit == new.commit


@pytest.mark.parametrize(
    "name",
    ["build/torch-cpu/../../outside.py", "build/../escaped.py", "build/torch-cpu/a\\..\\b.py"],
)
def test_path_escaping_names_in_a_listing_are_refused_before_download(publish, hub_env, name):
    new = publish("1.1.0")
    hub_env.tamper(REPO, new.commit, name, b"print('escaped')\n")
    with pytest.raises(IntegrityError, match=r"escapes"):
        get_kernel("rmsnorm", version="1.1.0")
    assert hub_env.downloads() == []


def test_symlink_in_a_kernel_source_is_refused_at_build(kernel_copy, tmp_path):
    source = kernel_copy("1.0.0")
    secret = tmp_path / "secret.txt"
    secret.write_text("not for publishing")
    (source / "rmsnorm" / "notes.txt").symlink_to(secret)
    with pytest.raises(IntegrityError, match=r"rmsnorm/notes\.txt: a symlink to .*secret\.txt"):
        build_kernel(source, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def _cached_variant(tmp_path, commit):
    return repo_cache(tmp_path) / "snapshots" / commit / "build" / "torch-cpu"


@pytest.mark.parametrize("change", ["file-link-out", "folder-link", "extra-module", "edited"])
def test_cache_changed_after_verification_is_caught_at_the_next_load(
    publish, hub_env, tmp_path, change
):
    new = publish("1.1.0")
    get_kernel("rmsnorm", version="1.1.0")
    package = _cached_variant(tmp_path, new.commit) / "rmsnorm"
    outside = tmp_path / "outside"
    outside.mkdir()
    if change == "file-link-out":  # same bytes, but no longer the cache's own blob
        (outside / "api.py").write_bytes((package / "api.py").read_bytes())
        (package / "api.py").unlink()
        (package / "api.py").symlink_to(outside / "api.py")
        expected = r"rmsnorm/api\.py: a symlink to"
    elif change == "folder-link":  # a package folder would shadow api.py and is not walked
        (outside / "__init__.py").write_text("raise SystemExit('planted')\n")
        (package / "api").symlink_to(outside, target_is_directory=True)
        expected = r"rmsnorm/api: a symlink to"
    elif change == "extra-module":
        (package / "extra.py").write_text("print('planted')\n")
        expected = r"not in digest: build/torch-cpu/rmsnorm/extra\.py"
    else:
        target = (package / "layers.py").resolve()
        target.write_text(target.read_text() + "\n# edited in the cache\n")
        expected = r"changed: build/torch-cpu/rmsnorm/layers\.py"
    with pytest.raises(IntegrityError, match=expected):
        get_kernel("rmsnorm", version="1.1.0")
    assert_nothing_half_written(tmp_path, new.commit)
    assert get_kernel("rmsnorm", version="1.1.0").origin.commit == new.commit  # re-downloaded


def test_planted_bytecode_is_deleted_before_import(publish, hub_env, tmp_path):
    new = publish("1.1.0")
    get_kernel("rmsnorm", version="1.1.0")
    pycache = _cached_variant(tmp_path, new.commit) / "rmsnorm" / "__pycache__"
    pycache.mkdir(exist_ok=True)
    planted = pycache / f"api.{sys.implementation.cache_tag}.pyc"
    planted.write_bytes(b"planted bytecode Python would prefer to the verified source")
    assert get_kernel("rmsnorm", version="1.1.0").origin.commit == new.commit
    assert not planted.exists()


_RACE = textwrap.dedent(
    """
    import json, os, sys, threading, time
    from kernel_hub.hub.fetch import HubRequest, fetch_build
    from kernel_hub.registry.registry import load_registry

    registry = load_registry()
    entry = registry.get("rmsnorm")
    go, results, errors = sys.argv[1], [], []
    open(f"{go}.ready-{os.getpid()}", "w").close()
    while not os.path.exists(go):
        time.sleep(0.01)
    barrier = threading.Barrier(8)

    def fetch():
        barrier.wait()
        try:
            build = fetch_build(  # platform given: the race needs no JAX (seconds per process)
                HubRequest.for_op(entry, "1.1.0"),
                what="op rmsnorm",
                platform="cpu",
                keys=registry.keys_for(entry.repo),
            )
            results.append([build.commit, str(build.path), build.signed_by])
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=fetch) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    alive = sum(t.is_alive() for t in threads)
    print(json.dumps({"results": results, "errors": errors, "alive": alive}))
    """
)


@pytest.mark.slow
def test_two_processes_and_eight_threads_each_fetch_one_build_once(publish, hub_env, tmp_path):
    new = publish("1.1.0")
    go = tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    children = [
        subprocess.Popen(
            [sys.executable, "-P", "-c", _RACE, str(go)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(2)
    ]
    deadline = time.monotonic() + 120
    while len(list(tmp_path.glob("go.ready-*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)  # both processes imported and waiting: release them together
    go.touch()
    outputs = [child.communicate(timeout=240) for child in children]
    assert [child.returncode for child in children] == [0, 0], [err[-2000:] for _, err in outputs]
    reports = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    for report, (_, err) in zip(reports, outputs, strict=True):
        assert report["errors"] == [] and report["alive"] == 0, err[-2000:]
        assert len(report["results"]) == 8
    seen = {tuple(r) for report in reports for r in report["results"]}
    assert len(seen) == 1 and next(iter(seen))[0] == new.commit
    downloads = hub_env.downloads("/build/torch-cpu/") + hub_env.downloads("/signatures/")
    files = [p for p in hub_env.files(REPO, new.commit) if p.startswith("build/torch-cpu/")]
    assert len(downloads) == len(files) + 1 == len(set(downloads))  # every file exactly once
    assert get_kernel("rmsnorm", version="1.1.0").origin.commit == new.commit  # verifies again


def test_mirror_disk_full_leaves_no_commit_in_the_store(publish, hub_env, tmp_path, monkeypatch):
    from kernel_hub.hub import store as store_module
    from kernel_hub.hub.mirror import mirror_registry
    from kernel_hub.registry.registry import load_registry

    publish("1.1.0")
    written = []
    real_write = store_module._write_atomic

    def fill_disk(path, data):
        if path.parent.name == "blobs" and len(written) >= 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written.append(path)
        real_write(path, data)

    monkeypatch.setattr(store_module, "_write_atomic", fill_disk)
    with pytest.raises(KernelHubError, match=r"No space left on device.*holds no part of") as info:
        mirror_registry(load_registry(), tmp_path / "mirror")
    assert "mirroring op rmsnorm" in str(info.value)
    mirror = tmp_path / "mirror"
    assert not (mirror / "repos").exists()  # no repo, commit or ref was recorded
    assert not [p for p in mirror.rglob(".*") if p.name != ".lock"]  # no temporary files
