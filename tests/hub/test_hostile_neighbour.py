"""A hostile neighbour: a second "user" with write access to a shared cache plants symlinks (the
staging folders, snapshots, refs, the index cache) or folders of their own. Each case ends in a
clear error or the genuine build, with nothing outside the cache written or deleted (docs/trust.md,
"Cache")."""

from __future__ import annotations

import os
import shutil
import stat
import threading
import time
from pathlib import Path

import pytest

from kernel_hub.errors import HubError, IntegrityError, KernelHubError
from kernel_hub.hub import cache, index
from kernel_hub.loading.resolver import get_kernel

from . import test_hostile_server as hostile
from .hub_helpers import cache_dir
from .test_hostile_server import REPO_CACHE, assert_clean_and_good_still_loads

victim = hostile.victim  # a good 1.0.0 cached before the attack
indexed = hostile.indexed  # the same, with the publisher's index required

DAY = 24 * 3600


def outside(tmp_path: Path) -> Path:
    """A folder outside the cache, with two day-old subfolders (what a stale-staging cleanup that
    followed a link would delete)."""
    folder = tmp_path / "outside"
    for name in ("old-a", "old-b"):
        (folder / name).mkdir(parents=True)
        (folder / name / "data.txt").write_text(f"{name} belongs to someone else\n")
        os.utime(folder / name, (time.time() - 2 * DAY,) * 2)
    return folder


def contents(folder: Path) -> dict[str, bytes | None]:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes() if p.is_file() else None
        for p in sorted(folder.rglob("*"))
    }


def repo_cache(tmp_path: Path) -> Path:
    return cache_dir(tmp_path) / REPO_CACHE


def test_planted_staging_links_are_neither_followed_nor_cleaned(
    victim, publish, hub_env, tmp_path, monkeypatch
):
    new = publish("1.1.0")
    target = outside(tmp_path)
    before = contents(target)
    (repo_cache(tmp_path) / ".staging").symlink_to(target)
    (repo_cache(tmp_path) / ".staging-planted").symlink_to(target)
    assert get_kernel("rmsnorm", version="1.1.0").origin.commit == new.commit
    assert contents(target) == before
    assert_clean_and_good_still_loads(tmp_path, monkeypatch, victim)


def test_only_stale_staging_carrying_kernel_hubs_marker_is_removed(victim, publish, tmp_path):
    publish("1.1.0")
    ours = repo_cache(tmp_path) / ".staging-ours"
    theirs = repo_cache(tmp_path) / ".staging-theirs"
    for folder in (ours, theirs):
        (folder / "build").mkdir(parents=True)
        os.utime(folder, (time.time() - 2 * DAY,) * 2)
    (ours / cache.STAGING_MARKER).touch()
    os.utime(ours, (time.time() - 2 * DAY,) * 2)
    get_kernel("rmsnorm", version="1.1.0")
    assert not ours.exists()
    assert (theirs / "build").is_dir()


def test_a_planted_snapshot_link_is_refused_and_nothing_is_written_through_it(
    victim, publish, hub_env, tmp_path, monkeypatch
):
    new = publish("1.1.0")
    target = outside(tmp_path)
    before = contents(target)
    (repo_cache(tmp_path) / "snapshots" / new.commit).symlink_to(target)
    with pytest.raises(HubError, match=r"a symlink \(to .*outside\) kernel-hub did not create"):
        get_kernel("rmsnorm", version="1.1.0")
    assert contents(target) == before
    (repo_cache(tmp_path) / "snapshots" / new.commit).unlink()
    assert_clean_and_good_still_loads(tmp_path, monkeypatch, victim)
    assert get_kernel("rmsnorm", version="1.1.0").origin.commit == new.commit


def test_a_cached_snapshot_swapped_for_a_link_is_not_deleted_through(victim, tmp_path):
    """The genuine snapshot replaced by a link to a forged copy outside the cache: the forgery
    is refused, and the refusal's cleanup does not follow the link."""
    snapshot = repo_cache(tmp_path) / "snapshots" / victim.commit
    forged = tmp_path / "outside" / "forged"
    shutil.copytree(snapshot, forged)
    api = next(forged.rglob("api.py"))
    api.write_bytes(api.read_bytes() + b"\n# changed\n")
    shutil.rmtree(snapshot)
    snapshot.symlink_to(forged)
    before = contents(forged)
    with pytest.raises(HubError, match=r"a symlink .* kernel-hub did not create"):
        get_kernel("rmsnorm", version="1.0.0")
    assert contents(forged) == before


def test_a_planted_ref_link_is_replaced_not_written_through(
    victim, publish, hub_env, tmp_path, monkeypatch
):
    new = publish("1.1.0")
    secret = tmp_path / "outside-secret.txt"
    secret.write_text("not the cache's\n")
    ref = repo_cache(tmp_path) / "refs" / "v1.1.0"
    ref.symlink_to(secret)
    assert get_kernel("rmsnorm", version="1.1.0").origin.commit == new.commit
    assert secret.read_text() == "not the cache's\n"
    assert not ref.is_symlink() and ref.read_text() == new.commit
    assert_clean_and_good_still_loads(tmp_path, monkeypatch, victim)


def test_a_planted_index_cache_link_is_refused(indexed, hub_env, tmp_path):
    # A client with no record of its own reads the one an earlier version kept in the cache.
    index.seen_record_path("kernel-hub").unlink()
    cached = index.cached_index_dir("kernel-hub") / index.CACHED_FILE
    secret = tmp_path / "outside-index.txt"
    secret.write_text("someone else's file\n")
    cached.parent.mkdir(parents=True, exist_ok=True)
    cached.symlink_to(secret)
    with pytest.raises(HubError, match=r"refusing the cached index"):
        get_kernel("rmsnorm", version="1.0.0")
    assert secret.read_text() == "someone else's file\n"
    cached.unlink()
    assert get_kernel("rmsnorm", version="1.0.0").origin.commit == indexed.commit


def test_a_state_folder_others_can_write_is_refused(indexed, hub_env):
    folder = index.seen_record_path("kernel-hub").parent
    folder.chmod(0o770)
    with pytest.raises(HubError, match=r"refusing kernel-hub's state folder .*others can write"):
        get_kernel("rmsnorm", version="1.0.0")
    folder.chmod(0o700)
    assert get_kernel("rmsnorm", version="1.0.0").origin.commit == indexed.commit


def test_an_earlier_versions_record_in_the_cache_is_read_until_this_user_has_one(
    indexed, hub_env, monkeypatch
):
    record = index.seen_record_path("kernel-hub")
    legacy = index.cached_index_dir("kernel-hub") / index.CACHED_FILE
    legacy.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(record, legacy)  # where kernel-hub kept it before
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert get_kernel("rmsnorm", version="1.0.0").origin.commit == indexed.commit
    assert not record.exists()
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    assert get_kernel("rmsnorm", version="1.0.0").origin.commit == indexed.commit
    assert record.is_file() and stat.S_IMODE(record.parent.stat().st_mode) == 0o700


def test_cache_folders_of_another_user_are_refused(victim, publish, hub_env, monkeypatch):
    publish("1.1.0")
    uid = os.geteuid()
    monkeypatch.setattr(os, "geteuid", lambda: uid + 1)  # every folder now looks someone else's
    with pytest.raises(HubError, match=rf"owned by user id {uid}, not this user \({uid + 1}\)"):
        get_kernel("rmsnorm", version="1.1.0")


def test_a_group_writable_cache_is_warned_about_once(
    victim, publish, hub_env, tmp_path, monkeypatch, caplog
):
    publish("1.1.0")
    monkeypatch.setattr(cache, "_warned_writable", set())
    cache_dir(tmp_path).chmod(0o775)
    get_kernel("rmsnorm", version="1.1.0")
    get_kernel("rmsnorm", version="1.0.0")
    warnings = [r for r in caplog.records if "writable by its group or by everyone" in r.message]
    assert len(warnings) == 1


def test_two_builds_of_one_repo_fetched_at_once_do_not_race(publish, hub_env):
    """Each fetch stages in its own folder: no fetch removes a folder another is using."""
    builds = {v: publish(v).commit for v in ("1.0.0", "1.1.0")}
    from kernel_hub.loading.resolver import fetch_op_build
    from kernel_hub.registry.registry import load_registry

    registry = load_registry()
    entry = registry.get("rmsnorm")
    barrier = threading.Barrier(6)
    results: list[object] = []

    def fetch(version: str) -> None:
        barrier.wait()
        try:
            build = fetch_op_build(entry, version=version, keys=registry.keys_for(entry.repo))
            results.append((version, build.commit))
        except Exception as exc:  # reported by the assertion below
            results.append(exc)

    threads = [threading.Thread(target=fetch, args=(v,)) for v in ("1.0.0", "1.1.0") * 3]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert all(isinstance(r, tuple) for r in results), results
    assert sorted(results) == sorted((v, c) for v, c in builds.items() for _ in range(3))


@pytest.mark.parametrize("kind", ["a file", "under a file"])
def test_an_unusable_hf_hub_cache_is_a_clear_error_naming_it(
    publish, hub_env, tmp_path, monkeypatch, kind
):
    publish("1.1.0")
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("HF_HUB_CACHE", str(blocker if kind == "a file" else blocker / "hub"))
    with pytest.raises(KernelHubError, match=r"cache .*not-a-folder.* \(HF_HUB_CACHE, else"):
        get_kernel("rmsnorm", version="1.1.0")


@pytest.mark.parametrize("planted", ["a link in the build", "the signature swapped for a link"])
def test_a_planted_blobs_link_makes_the_refusal_delete_nothing_outside_the_cache(
    victim, hub_env, tmp_path, monkeypatch, planted
):
    """An older cache's links into ``blobs/`` are the one kind of link a build may hold: a
    ``blobs`` planted as a link to a user's files, and a link through it in the cached build,
    make the build refused and discarded, but the discard deletes none of the files it leads to."""
    precious = tmp_path / "home" / "work"
    precious.mkdir(parents=True)
    (precious / "thesis.tex").write_text("years of work\n")
    (repo_cache(tmp_path) / "blobs").symlink_to(precious)
    snapshot = repo_cache(tmp_path) / "snapshots" / victim.commit
    through = repo_cache(tmp_path) / "blobs" / "thesis.tex"
    if planted == "a link in the build":
        (snapshot / "build" / "torch-cpu" / "notes.txt").symlink_to(through)
    else:
        (snapshot / "signatures" / "torch-cpu.sig").unlink()
        (snapshot / "signatures" / "torch-cpu.sig").symlink_to(through)
    with pytest.raises(IntegrityError, match=r"a symlink to .*thesis\.tex, outside the build"):
        get_kernel("rmsnorm", version="1.0.0")
    assert (precious / "thesis.tex").read_text() == "years of work\n"
    assert not snapshot.joinpath("build", "torch-cpu").exists()  # discarded
    assert get_kernel("rmsnorm", version="1.0.0").origin.commit == victim.commit  # fetched again
    assert (precious / "thesis.tex").read_text() == "years of work\n"
    assert_clean_and_good_still_loads(tmp_path, monkeypatch, victim)


def test_a_snapshot_swapped_for_a_link_deletes_no_bytecode_outside_the_cache(victim, tmp_path):
    """The bytecode caches a build may not hold are deleted only once every folder down to the
    build is a real one of this user's: never through a planted snapshot link."""
    snapshot = repo_cache(tmp_path) / "snapshots" / victim.commit
    elsewhere = tmp_path / "outside" / "project"
    shutil.copytree(snapshot, elsewhere)
    bytecode = elsewhere / "build" / "torch-cpu" / "rmsnorm" / "__pycache__"
    bytecode.mkdir()
    (bytecode / "api.cpython-311.pyc").write_bytes(b"someone else's bytecode")
    shutil.rmtree(snapshot)
    snapshot.symlink_to(elsewhere)
    with pytest.raises(HubError, match=r"a symlink .* kernel-hub did not create"):
        get_kernel("rmsnorm", version="1.0.0")
    assert (bytecode / "api.cpython-311.pyc").read_bytes() == b"someone else's bytecode"


@pytest.mark.parametrize("offline", [False, True])
def test_a_signature_swapped_for_a_fifo_is_refused_without_waiting_on_it(
    victim, hub_env, tmp_path, monkeypatch, offline
):
    signature = repo_cache(tmp_path) / "snapshots" / victim.commit / "signatures" / "torch-cpu.sig"
    signature.unlink()
    os.mkfifo(signature)
    if offline:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    outcome: list[object] = []

    def load() -> None:
        try:
            outcome.append(get_kernel("rmsnorm", version="1.0.0").origin.commit)
        except KernelHubError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    thread.join(120)
    assert not thread.is_alive(), "the load waits on a FIFO planted as the signature"
    (refusal,) = outcome
    assert "torch-cpu.sig is not a regular file" in str(refusal)
    assert not signature.exists()  # discarded with its build
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    assert get_kernel("rmsnorm", version="1.0.0").origin.commit == victim.commit
    assert stat.S_ISREG(signature.lstat().st_mode)


def test_cache_folders_are_writable_by_this_user_only_under_a_shared_umask(
    victim, publish, hub_env, tmp_path, monkeypatch
):
    """Under umask 002 (a team cache) kernel-hub's folders would let the group plant links where
    it reads and deletes: they are made 0755, and one left group-writable is tightened."""
    old_umask = os.umask(0o002)
    try:
        build = repo_cache(tmp_path) / "snapshots" / victim.commit / "build"
        build.chmod(0o775)
        new = publish("1.1.0")
        assert get_kernel("rmsnorm", version="1.1.0").origin.commit == new.commit
        assert get_kernel("rmsnorm", version="1.0.0").origin.commit == victim.commit
    finally:
        os.umask(old_umask)
    folders = [repo_cache(tmp_path)] + [
        p for p in repo_cache(tmp_path).rglob("*") if p.is_dir() and ".staging" not in p.name
    ]
    assert [p for p in folders if p.stat().st_mode & (stat.S_IWGRP | stat.S_IWOTH)] == []
    assert (repo_cache(tmp_path) / "snapshots" / new.commit / "build" / "torch-cpu").is_dir()
