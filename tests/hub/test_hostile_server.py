"""A hostile hub: kernel-hub's own server with a handler that lies (docs/trust.md, threat model).

Each attack checks what the client did, that nothing the attacker sent is left anywhere on disk
(the whole test folder is scanned: the cache, ``HF_HOME``, ``HOME`` and a site-packages-like
folder, everything but the server's own store), and that a good build cached before the attack
still loads offline afterwards.
"""

from __future__ import annotations

import datetime as dt
import json
import os
from pathlib import Path

import pytest
import yaml

from kernel_hub.cli import main
from kernel_hub.errors import HubError, IntegrityError, KernelHubError
from kernel_hub.hub import cache, fetch, index
from kernel_hub.hub.locking import lock_registry
from kernel_hub.hub.publish import publish_kernel
from kernel_hub.hub.signing import SigningKey
from kernel_hub.hub.transfer import MAX_METADATA_BYTES
from kernel_hub.loading.resolver import get_kernel
from kernel_hub.registry.registry import load_registry

from .hub_helpers import REPO, cache_dir, signed_registry
from .hub_server import Fault

MARK = b"kernel-hub-attacker-was-here"
PAYLOAD = b"import os; os.environ['PWNED'] = '1'  # " + MARK + b"\n"
API_FILE = "build/torch-cpu/rmsnorm/api.py"
METADATA = "build/torch-cpu/metadata.json"
REPO_CACHE = "kernels--kernel-hub--rmsnorm"


@pytest.fixture
def victim(publish, hub_env, tmp_path, monkeypatch):
    """A good 1.0.0 build, fetched and cached before the attack; HOME and a site-packages-like
    folder inside the test folder so the scan covers where an attacker would aim."""
    home = tmp_path / "home"
    (tmp_path / "site-packages").mkdir()
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    good = publish("1.0.0")
    assert get_kernel("rmsnorm", version="1.0.0").origin.commit == good.commit
    return good


def attacker_files(tmp_path: Path) -> list[Path]:
    """Every file (or link) under the test folder, outside the server's store, holding ``MARK``
    or named by the attacker."""
    found = []
    for directory, dirs, files in os.walk(tmp_path):
        if Path(directory) == tmp_path:
            dirs[:] = [d for d in dirs if d != "hub-store"]
        for name in files + dirs:
            path = Path(directory, name)
            planted = path.is_file() and not path.is_symlink() and MARK in path.read_bytes()
            if planted or "evil" in name:
                found.append(path)
    return found


def assert_clean_and_good_still_loads(tmp_path, monkeypatch, good) -> None:
    assert attacker_files(tmp_path) == []
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    try:
        module = get_kernel("rmsnorm", version="1.0.0")
        assert module.origin.commit == good.commit
        assert MARK not in Path(module.__file__).read_bytes()
    finally:
        monkeypatch.delenv("HF_HUB_OFFLINE")


def _resolve_of(path: str, name: str) -> bool:
    return "/resolve/" in path and path.endswith(name)


# -- 1. nothing the server controls names a path --------------------------------------------------


def test_a_forged_etag_writes_nothing_outside_the_cache(
    victim, publish, hub_env, tmp_path, monkeypatch
):
    publish("1.1.0")
    blobs = cache_dir(tmp_path) / "kernels--kernel-hub--rmsnorm" / "blobs"
    target = tmp_path / "site-packages" / "evil.pth"
    etag = os.path.relpath(target, blobs)

    def lie(method, path, status, body, headers):
        if _resolve_of(path, "rmsnorm/api.py"):
            headers["ETag"] = f'"{etag}"'
            headers["X-Linked-Etag"] = f'"{etag}"'
            headers["X-Linked-Size"] = str(len(PAYLOAD))
            headers["Content-Length"] = str(len(PAYLOAD))
            body = PAYLOAD
        return status, body, headers

    hub_env.lie = lie
    with pytest.raises(KernelHubError):
        get_kernel("rmsnorm", version="1.1.0")
    hub_env.lie = None
    assert not target.exists()
    assert_clean_and_good_still_loads(tmp_path, monkeypatch, victim)


def _lie_on(hub, match, rewrite, times: int | None = None):
    """Serve ``rewrite(status, body, headers)`` for requests whose path ``match``es; the rest
    honestly. ``times``: only that many times, then honest again."""
    seen = []

    def lie(method, path, status, body, headers):
        if method == "GET" and match(path) and (times is None or len(seen) < times):
            seen.append(path)
            return rewrite(status, body, headers)
        return status, body, headers

    hub.lie = lie
    return seen


def _json_lie(edit):
    def rewrite(status, body, headers):
        data = json.loads(body)
        edit(data)
        return status, json.dumps(data).encode(), headers

    return rewrite


def test_a_forged_commit_id_in_the_refs_names_nothing(
    victim, publish, hub_env, tmp_path, monkeypatch
):
    publish("1.1.0")

    def forge(refs):
        for tag in refs["tags"]:
            if tag["name"] == "v1.1.0":
                tag["targetCommit"] = "../../../site-packages/evil"

    _lie_on(hub_env, lambda p: p.endswith("/refs"), _json_lie(forge))
    before = len(hub_env.downloads())
    with pytest.raises(IntegrityError, match=r"'\.\./\.\./\.\./site-packages/evil'.*not a 40-hex"):
        get_kernel("rmsnorm", version="1.1.0")
    assert len(hub_env.downloads()) == before  # refused before any download
    hub_env.lie = None
    assert_clean_and_good_still_loads(tmp_path, monkeypatch, victim)


@pytest.mark.parametrize(
    "name",
    ["build/torch-cpu/rmsnorm/evil\x00.py", "build/torch-cpu/../../../site-packages/evil.pth"],
)
def test_a_forged_name_in_the_listing_is_a_clear_error(
    victim, publish, hub_env, tmp_path, monkeypatch, name
):
    publish("1.1.0")

    def forge(entries):
        entries.append({"type": "file", "path": name, "size": len(PAYLOAD), "oid": "0" * 40})

    _lie_on(hub_env, lambda p: "/tree/" in p, _json_lie(forge))
    before = len(hub_env.downloads())
    with pytest.raises(IntegrityError, match=r"refusing file name .*evil"):
        get_kernel("rmsnorm", version="1.1.0")
    assert len(hub_env.downloads()) == before
    hub_env.lie = None
    assert_clean_and_good_still_loads(tmp_path, monkeypatch, victim)


def test_an_undigested_file_beside_the_build_is_never_downloaded(
    victim, publish, hub_env, tmp_path, monkeypatch
):
    new = publish("1.1.0")
    hub_env.tamper(REPO, new.commit, "build/torch-cpu/rmsnorm/evil.py", PAYLOAD)
    module = get_kernel("rmsnorm", version="1.1.0")  # the signed build, without the extra file
    assert module.origin.commit == new.commit
    assert hub_env.downloads("evil") == []
    assert_clean_and_good_still_loads(tmp_path, monkeypatch, victim)


def test_a_file_larger_than_its_signed_size_is_cut_off(
    victim, publish, hub_env, tmp_path, monkeypatch
):
    publish("1.1.0")
    huge = PAYLOAD * 100_000  # ~6 MB, far over the signed size of api.py

    def stream_more(status, body, headers):
        return status, huge, {k: v for k, v in headers.items() if k != "Content-Length"}

    _lie_on(hub_env, lambda p: _resolve_of(p, "rmsnorm/api.py"), stream_more)
    with pytest.raises(
        IntegrityError, match=r"changed: build/torch-cpu/rmsnorm/api\.py \(.*over \d+"
    ):
        get_kernel("rmsnorm", version="1.1.0")
    hub_env.lie = None
    assert_clean_and_good_still_loads(tmp_path, monkeypatch, victim)


def test_oversized_metadata_is_refused_before_it_is_parsed(
    victim, publish, hub_env, tmp_path, monkeypatch
):
    publish("1.1.0")
    parsed = []
    real_loads = json.loads
    monkeypatch.setattr(
        json, "loads", lambda text, *a, **k: parsed.append(len(text)) or real_loads(text, *a, **k)
    )
    bloated = b'{"pad": "' + MARK * (2 * MAX_METADATA_BYTES // len(MARK)) + b'"}'
    _lie_on(hub_env, lambda p: _resolve_of(p, METADATA), lambda s, b, h: (s, bloated, h))
    with pytest.raises(IntegrityError, match=rf"changed: {METADATA} \(.*over {MAX_METADATA_BYTES}"):
        get_kernel("rmsnorm", version="1.1.0")
    assert all(n < MAX_METADATA_BYTES for n in parsed)  # nothing that large reached the parser
    hub_env.lie = None
    monkeypatch.setattr(json, "loads", real_loads)
    assert_clean_and_good_still_loads(tmp_path, monkeypatch, victim)


# -- 2. the version is bound to every kind of request ---------------------------------------------


def _registry(tmp_path, monkeypatch, keys, **entry) -> None:
    """The test registry with the rmsnorm entry's fields replaced by ``entry``."""
    (tmp_path / "reg").mkdir(exist_ok=True)
    path = signed_registry(tmp_path / "reg", ["rmsnorm"], [keys["publisher"].public_key])
    data = yaml.safe_load(path.read_text())
    data["ops"]["rmsnorm"].update(entry)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    monkeypatch.setenv("KERNEL_HUB_REGISTRY", str(path))


def test_a_moved_branch_cannot_roll_back_below_the_registry_range(
    victim, publish, hub_env, tmp_path, monkeypatch, keys
):
    publish("1.1.0")
    _registry(tmp_path, monkeypatch, keys, version=">=1.1,<2", revision="v1")
    hub_env.store.set_ref("kernel", REPO, "branch", "v1", victim.commit, create=False)
    with pytest.raises(IntegrityError, match=r"v1 holds version 1\.0\.0, outside .*>=1\.1"):
        get_kernel("rmsnorm", source="hub")
    assert_clean_and_good_still_loads(tmp_path, monkeypatch, victim)


def test_a_major_branch_cannot_hold_another_major_version(
    victim, publish, hub_env, tmp_path, monkeypatch
):
    two = publish("2.0.0")
    hub_env.store.set_ref("kernel", REPO, "branch", "v1", two.commit, create=False)
    with pytest.raises(IntegrityError, match=r"v1 holds version 2\.0\.0, outside .*<2"):
        get_kernel("rmsnorm", revision="v1")
    assert_clean_and_good_still_loads(tmp_path, monkeypatch, victim)


def test_a_pinned_commit_relabelled_below_the_range_is_refused(
    victim, publish, hub_env, tmp_path, monkeypatch, keys
):
    new = publish("1.1.0")
    _registry(tmp_path, monkeypatch, keys, version=">=1.1,<2", commit=new.commit)
    for path, data in hub_env.files(REPO, victim.commit).items():  # 1.0.0, validly signed
        hub_env.tamper(REPO, new.commit, path, data)
    with pytest.raises(IntegrityError, match=rf"{new.commit} holds version 1\.0\.0, outside"):
        get_kernel("rmsnorm", source="hub")
    assert not (cache_dir(tmp_path) / REPO_CACHE / "snapshots" / new.commit).exists()
    assert_clean_and_good_still_loads(tmp_path, monkeypatch, victim)


def test_a_lock_in_the_working_directory_cannot_leave_the_registry_range(
    victim, publish, hub_env, tmp_path, monkeypatch, keys
):
    lock_registry(load_registry(), tmp_path / "kernel-hub.lock")  # pins 1.0.0, in the cwd
    publish("1.1.0")
    _registry(tmp_path, monkeypatch, keys, version=">=1.1,<2")
    before = len(hub_env.requests)
    with pytest.raises(
        HubError, match=r"pins kernel-hub/rmsnorm 1\.0\.0, outside .*>=1\.1.*explicit"
    ):
        get_kernel("rmsnorm")
    assert len(hub_env.requests) == before  # refused before any request
    named = get_kernel("rmsnorm", lock=tmp_path / "kernel-hub.lock")  # named: the user's choice
    assert named.origin.commit == victim.commit
    monkeypatch.setenv("KERNEL_HUB_LOCK", str(tmp_path / "kernel-hub.lock"))
    assert get_kernel("rmsnorm").origin.commit == victim.commit


def test_an_offline_tag_lookup_checks_the_version(victim, publish, hub_env, tmp_path, monkeypatch):
    new = publish("1.1.0")
    assert get_kernel("rmsnorm", version="1.1.0").origin.commit == new.commit
    refs = cache_dir(tmp_path) / REPO_CACHE / "refs"
    (refs / "v1.1.0").write_text(victim.commit)  # a poisoned ref in the cache
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(IntegrityError, match=r"tag v1\.1\.0 holds a build of version 1\.0\.0"):
        get_kernel("rmsnorm", revision="v1.1.0")
    assert "v1.1.0" not in cache.cached_refs(REPO)  # the poisoned ref is forgotten
    monkeypatch.delenv("HF_HUB_OFFLINE")
    assert_clean_and_good_still_loads(tmp_path, monkeypatch, victim)


# -- 3. refusals clean only what is theirs ---------------------------------------------------------


def test_a_refused_build_leaves_no_ref_and_a_genuine_refetch_works(
    victim, publish, hub_env, tmp_path, monkeypatch
):
    new = publish("1.1.0")
    lies = _lie_on(
        hub_env,
        lambda p: _resolve_of(p, "rmsnorm/api.py"),
        lambda s, b, h: (s, PAYLOAD, h),
        times=1,
    )
    with pytest.raises(IntegrityError, match=r"changed: build/torch-cpu/rmsnorm/api\.py"):
        get_kernel("rmsnorm", version="1.1.0")
    assert len(lies) == 1
    repo_cache = cache_dir(tmp_path) / REPO_CACHE
    assert "v1.1.0" not in cache.cached_refs(REPO)
    assert not (repo_cache / "snapshots" / new.commit).exists()
    assert not list(repo_cache.glob(".staging*"))
    assert_clean_and_good_still_loads(tmp_path, monkeypatch, victim)
    # the hub answers honestly again: no manual cleanup needed
    assert get_kernel("rmsnorm", version="1.1.0").origin.commit == new.commit
    assert cache.cached_refs(REPO)["v1.1.0"] == new.commit


def test_discarding_an_older_cache_layout_keeps_blobs_others_link_to(hub_env, tmp_path):
    """Caches written through snapshot_download link files to blobs/<etag>; refusing one snapshot
    removes only the blobs no other snapshot links to."""
    repo_cache = cache_dir(tmp_path) / REPO_CACHE
    blobs = repo_cache / "blobs"
    blobs.mkdir(parents=True)
    (blobs / "shared").write_bytes(b"shared")
    (blobs / "own").write_bytes(b"own")
    good, bad = ("a" * 40, "b" * 40)
    for commit, names in ((good, ["shared"]), (bad, ["shared", "own"])):
        folder = repo_cache / "snapshots" / commit / "build" / "torch-cpu"
        folder.mkdir(parents=True)
        for name in names:
            (folder / f"{name}.py").symlink_to(blobs / name)
        cache.write_ref(REPO, f"ref-{commit[0]}", commit)
    cache.discard_variant(REPO, bad, "torch-cpu")
    assert sorted(p.name for p in blobs.iterdir()) == ["shared"]
    assert (repo_cache / "snapshots" / good / "build" / "torch-cpu" / "shared.py").read_bytes()
    assert cache.cached_refs(REPO) == {"ref-a": good}


# -- 4. one read ----------------------------------------------------------------------------------


def test_the_bytes_imported_are_the_bytes_verified(victim, publish, hub_env, tmp_path, monkeypatch):
    """A local attacker who swaps a cached file right after it was verified does not get it
    imported: the import reads this process's private copy of the verified bytes."""
    new = publish("1.1.0")
    real_hash_tree = fetch.hash_tree

    def swap_after_hashing(root, **kwargs):
        digests = real_hash_tree(root, **kwargs)
        if kwargs.get("copy_to") is not None and "snapshots" in Path(root).parts:
            (Path(root) / "rmsnorm" / "api.py").write_bytes(PAYLOAD)
        return digests

    monkeypatch.setattr(fetch, "hash_tree", swap_after_hashing)
    monkeypatch.delenv("PWNED", raising=False)
    module = get_kernel("rmsnorm", version="1.1.0")
    assert module.origin.commit == new.commit and "PWNED" not in os.environ
    assert MARK not in (Path(module.__file__).parent / "api.py").read_bytes()
    monkeypatch.setattr(fetch, "hash_tree", real_hash_tree)
    with pytest.raises(IntegrityError, match=r"changed: build/torch-cpu/rmsnorm/api\.py"):
        get_kernel("rmsnorm", version="1.1.0")  # the next load sees the swap, and discards it
    assert_clean_and_good_still_loads(tmp_path, monkeypatch, victim)


# -- 5. limits and scope --------------------------------------------------------------------------


def test_an_org_revocation_reaches_a_repo_level_entry(
    victim, publish, hub_env, tmp_path, monkeypatch, keys
):
    path = signed_registry(
        tmp_path, ["rmsnorm"], [keys["rotated"].public_key], [keys["publisher"].public_key]
    )
    data = yaml.safe_load(path.read_text())
    data["publishers"][REPO] = {"keys": [keys["publisher"].public_key]}
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    monkeypatch.setenv("KERNEL_HUB_REGISTRY", str(path))
    publish("1.1.0")
    with pytest.raises(IntegrityError, match=r"signed by key .* lists as revoked"):
        get_kernel("rmsnorm", version="1.1.0")
    assert attacker_files(tmp_path) == []


# -- 6. freshness: the publisher's signed, expiring index ----------------------------------------


def _require_index(tmp_path, monkeypatch, keys, **entry) -> Path:
    (tmp_path / "reg").mkdir(exist_ok=True)
    path = signed_registry(tmp_path / "reg", ["rmsnorm"], [keys["publisher"].public_key])
    data = yaml.safe_load(path.read_text())
    data["publishers"]["kernel-hub"]["index"] = True
    data["ops"]["rmsnorm"].update(entry)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    monkeypatch.setenv("KERNEL_HUB_REGISTRY", str(path))
    return path


@pytest.fixture
def indexed(publish, hub_env, tmp_path, monkeypatch, keys):
    """As ``victim``, with 1.0.0 in the publisher's signed index and the registry requiring it."""
    (tmp_path / "home").mkdir()
    (tmp_path / "site-packages").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    _require_index(tmp_path, monkeypatch, keys)
    good = publish("1.0.0", index=True)
    assert get_kernel("rmsnorm", version="1.0.0").origin.commit == good.commit
    return good


def test_a_hub_hiding_the_newest_version_is_detected(
    indexed, publish, hub_env, tmp_path, monkeypatch
):
    new = publish("1.1.0", index=True)
    hub_env.store.set_ref("kernel", REPO, "tag", "v1.1.0", None, create=False)  # frozen at 1.0.0
    hub_env.store.set_ref("kernel", REPO, "branch", "v1", indexed.commit, create=False)
    for request in ({"version": ">=1,<2"}, {"revision": "v1"}):
        with pytest.raises(IntegrityError, match=r"lists 1\.1\.0 as the newest .*frozen or rolled"):
            get_kernel("rmsnorm", **request)
    hub_env.store.set_ref("kernel", REPO, "tag", "v1.1.0", new.commit, create=True)
    hub_env.store.set_ref("kernel", REPO, "branch", "v1", new.commit, create=False)
    assert get_kernel("rmsnorm", version=">=1,<2").origin.commit == new.commit
    assert_clean_and_good_still_loads(tmp_path, monkeypatch, indexed)


def test_a_major_branch_pointed_at_a_version_outside_it_is_refused(indexed, hub_env):
    """A ``v3`` branch at the listed 1.0.0 commit: the index lists no 3.x to be the newest of."""
    hub_env.store.set_ref("kernel", REPO, "branch", "v3", indexed.commit, create=True)
    with pytest.raises(IntegrityError, match=r"lists no version in .*>=3: the hub relabelled v3"):
        get_kernel("rmsnorm", revision="v3")


def test_a_commit_relabelled_inside_the_range_is_refused(
    indexed, publish, hub_env, tmp_path, monkeypatch, keys
):
    new = publish("1.1.0", index=True)
    _require_index(tmp_path, monkeypatch, keys, commit=new.commit)  # range >=1.0,<2 fits both
    for path, data in hub_env.files(REPO, indexed.commit).items():
        hub_env.tamper(REPO, new.commit, path, data)  # 1.0.0, validly signed, as that commit
    with pytest.raises(
        IntegrityError, match=rf"{new.commit} holds a build of version 1\.0\.0, not 1\.1\.0"
    ):
        get_kernel("rmsnorm", source="hub")
    assert_clean_and_good_still_loads(tmp_path, monkeypatch, indexed)


def test_an_unlisted_commit_and_a_missing_index_are_refused(
    indexed, publish, hub_env, tmp_path, monkeypatch
):
    unlisted = publish("1.1.0")  # published without updating the index
    with pytest.raises(
        IntegrityError, match=rf"commit {unlisted.commit[:12]}, which .* does not list"
    ):
        get_kernel("rmsnorm", revision=unlisted.commit)
    hub_env.inject_fault(
        Fault("GET", r"kernel-hub-index/refs$", 404, headers={"X-Error-Code": "RepoNotFound"})
    )
    with pytest.raises(
        IntegrityError, match=r"requires kernel-hub's signed index, but .* serves none"
    ):
        get_kernel("rmsnorm", version="1.0.0")
    hub_env.faults.clear()
    assert_clean_and_good_still_loads(tmp_path, monkeypatch, indexed)


def test_a_rolled_back_index_is_refused(indexed, publish, hub_env, tmp_path, monkeypatch):
    first = hub_env.branches("kernel-hub/kernel-hub-index")["main"]
    publish("1.1.0", index=True)
    get_kernel("rmsnorm", version=">=1,<2")  # this client has now seen serial 2
    hub_env.store.set_ref(
        "kernel", "kernel-hub/kernel-hub-index", "branch", "main", first, create=False
    )
    with pytest.raises(IntegrityError, match=r"serial 1.*already verified serial 2: .*rolled back"):
        get_kernel("rmsnorm", version="1.0.0")
    assert_clean_and_good_still_loads(tmp_path, monkeypatch, indexed)


def test_an_expired_index_is_refused_until_the_publisher_refreshes_it(
    indexed, hub_env, tmp_path, monkeypatch, keys, capsys
):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert get_kernel("rmsnorm", version="1.0.0").origin.commit == indexed.commit  # honoured
    later = index.now() + dt.timedelta(days=index.DEFAULT_EXPIRY_DAYS + 1)
    monkeypatch.setattr(index, "now", lambda: later)
    with pytest.raises(IntegrityError, match=r"serial 1, expires .* has expired"):
        get_kernel("rmsnorm", version="1.0.0")  # offline, the cached index is too old
    monkeypatch.delenv("HF_HUB_OFFLINE")
    with pytest.raises(IntegrityError, match=r"has expired"):
        get_kernel("rmsnorm", version="1.0.0")  # online, the hub only has the old one (frozen)
    registry = os.environ["KERNEL_HUB_REGISTRY"]
    argv = ["index", "refresh", "--publisher", "kernel-hub", "--registry", registry]
    assert (
        main([*argv, "--sign-key", str(keys["publisher"].private_path), "--expires-days", "30"])
        == 0
    )
    assert "serial 2" in capsys.readouterr().out
    assert get_kernel("rmsnorm", version="1.0.0").origin.commit == indexed.commit
    assert_clean_and_good_still_loads(tmp_path, monkeypatch, indexed)


def test_a_forged_index_is_refused(indexed, hub_env, tmp_path, monkeypatch):
    def forge(status, body, headers):
        return status, body.replace(b'"serial": 1', b'"serial": 99'), headers

    _lie_on(hub_env, lambda p: _resolve_of(p, "/index.json"), forge)
    with pytest.raises(
        IntegrityError, match=r"kernel-hub's index: the signature by key .* not verify"
    ):
        get_kernel("rmsnorm", version="1.0.0")
    hub_env.lie = None
    assert_clean_and_good_still_loads(tmp_path, monkeypatch, indexed)


# -- 7. key management ----------------------------------------------------------------------------


def test_a_lost_key_is_survived_with_the_pinned_backup_key(
    publish, hub_env, tmp_path, monkeypatch, keys, capsys
):
    """docs/trust.md: pin a primary and an offline backup key; when the primary is lost, the
    backup signs new builds and refreshes the index, and nothing the primary signed breaks."""
    registry = _require_index(tmp_path, monkeypatch, keys)
    data = yaml.safe_load(registry.read_text())
    data["publishers"]["kernel-hub"]["keys"].append(keys["rotated"].public_key)  # the backup
    registry.write_text(yaml.safe_dump(data, sort_keys=False))
    first = publish("1.0.0", index=True)  # by the primary, which is then lost
    second = publish("1.1.0", key="rotated", index=True)
    assert get_kernel("rmsnorm", version=">=1,<2").origin.commit == second.commit
    backup = str(keys["rotated"].private_path)
    argv = ["index", "refresh", "--publisher", "kernel-hub", "--registry", str(registry)]
    assert main([*argv, "--sign-key", backup, "--json"]) == 0
    refreshed = json.loads(capsys.readouterr().out)
    assert refreshed["serial"] == 3 and set(refreshed["kernels"][REPO]) == {"1.0.0", "1.1.0"}
    assert get_kernel("rmsnorm", version="1.0.0").origin.commit == first.commit
    # a key the registry does not pin cannot take over the index
    stranger = ["--sign-key", str(keys["stranger"].private_path)]
    assert main([*argv, *stranger]) == 0  # it can upload (the hub has no accounts) ...
    capsys.readouterr()
    with pytest.raises(IntegrityError, match=r"kernel-hub's index is signed by key .* not pinned"):
        get_kernel("rmsnorm", version="1.0.0")  # ... but no client accepts it


def test_a_threshold_needs_that_many_pinned_signatures(
    hub_env, kernel_copy, tmp_path, monkeypatch, keys
):
    """``threshold: 2``: one stolen key is not enough, and a signature by an unpinned key does not
    count; losing one of three keys still leaves two to sign with."""
    registry = _require_index(tmp_path, monkeypatch, keys)
    data = yaml.safe_load(registry.read_text())
    entry = data["publishers"]["kernel-hub"]
    entry["keys"].append(keys["rotated"].public_key)
    entry["threshold"] = 2
    entry["index"] = False
    registry.write_text(yaml.safe_dump(data, sort_keys=False))
    primary, backup, stranger = (keys[k].private_path for k in ("publisher", "rotated", "stranger"))

    def publish(version, *signers):
        return publish_kernel(kernel_copy(version), REPO, sign_key=list(signers))

    alone = publish("1.0.0", primary)  # one stolen key
    with pytest.raises(IntegrityError, match=r"signed by 1 of the 2 pinned keys .*requires"):
        get_kernel("rmsnorm", version="1.0.0")
    mixed = publish("1.0.1", primary, stranger)
    with pytest.raises(IntegrityError, match=r"1 of the 2 pinned keys.*not pinned"):
        get_kernel("rmsnorm", version="1.0.1")
    both = publish("1.1.0", primary, backup)
    assert get_kernel("rmsnorm", version="1.1.0").origin.commit == both.commit
    entry["index"] = True  # the index needs the same threshold
    registry.write_text(yaml.safe_dump(data, sort_keys=False))
    trusted = load_registry().keys_for(REPO)
    listed = {REPO: (both.version, both.commit)}
    with pytest.raises(IntegrityError, match=r"index is signed by 1 of the 2 pinned keys"):
        index.publish_index("kernel-hub", SigningKey(primary), trusted, add=listed)  # not uploaded
    signers = [SigningKey(primary), SigningKey(backup)]
    assert index.publish_index("kernel-hub", signers, trusted, add=listed).serial == 1
    assert get_kernel("rmsnorm", version=">=1,<2").origin.commit == both.commit
    snapshots = cache_dir(tmp_path) / REPO_CACHE / "snapshots"
    assert not (snapshots / alone.commit).exists() and not (snapshots / mixed.commit).exists()
    assert attacker_files(tmp_path) == []
