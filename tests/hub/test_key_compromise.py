"""A stolen signing key, played through (docs/trust.md, "Stolen key: the recovery procedure").

The registry pins a primary key and an offline backup (``backup:``) for the publisher and
requires its signed index. The thief holds the primary: he signs builds and indexes and serves
them from the hub (kernel-hub's own server on 127.0.0.1) until the publisher revokes the key.
Each test checks that clients recover online with nothing deleted by hand, and that the thief,
holding only the primary, can neither undo the revocation nor lock the backup out.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import shutil

import pytest
import yaml

from kernel_hub.cli import main
from kernel_hub.errors import IntegrityError, UntrustedSourceError
from kernel_hub.hub import index, settings
from kernel_hub.hub.publish import publish_kernel
from kernel_hub.hub.signing import SigningKey
from kernel_hub.loading.resolver import get_kernel
from kernel_hub.registry.registry import load_registry

from .hub_helpers import REPO, signed_registry

INDEX_REPO = "kernel-hub/kernel-hub-index"
RANGE = ">=1,<2"
REVOKED = r"signed by key .*, which .* lists as revoked"


@pytest.fixture
def registry(hub_env, tmp_path, monkeypatch, keys):
    """The registry: primary ``publisher`` under ``keys:``, ``rotated`` as the backup, and the
    signed index required; returned as its path."""
    path = signed_registry(tmp_path, ["rmsnorm"], [keys["publisher"].public_key])
    data = yaml.safe_load(path.read_text())
    data["publishers"]["kernel-hub"].update(backup=[keys["rotated"].public_key], index=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    monkeypatch.setenv("KERNEL_HUB_REGISTRY", str(path))
    return path


@pytest.fixture
def publish_as(registry, kernel_copy, keys):
    """``publish_as("1.1.0", "rotated")``: rmsnorm at that version, signed by that key and added
    to the index, checked against the registry as it is now (what ``publish --index`` does)."""

    def run(version: str, key: str):
        org_keys = load_registry().publishers["kernel-hub"]
        sign = keys[key].private_path
        return publish_kernel(kernel_copy(version), REPO, sign_key=sign, index=org_keys)

    return run


def revoke_in_registry(path, key: str) -> None:
    """Ship a registry that revokes ``key`` (moved from ``keys:`` to ``revoked:``)."""
    data = yaml.safe_load(path.read_text())
    entry = data["publishers"]["kernel-hub"]
    entry["keys"] = [k for k in entry["keys"] if k != key]
    entry["revoked"] = [key]
    path.write_text(yaml.safe_dump(data, sort_keys=False))


def serve_index(hub, signer, serial: int, kernels, *, revoked=(), expires_days: float = 7) -> None:
    """The hub's index repo serves this index from now on, signed by ``signer`` (a KeyPair)."""
    expires = index.now() + dt.timedelta(days=expires_days)
    data = index.make_index("kernel-hub", serial, expires, kernels, revoked)
    signature = index.sign_index([SigningKey(signer.private_path)], "kernel-hub", data)
    hub.tamper(INDEX_REPO, "main", index.INDEX_FILE, data)
    hub.tamper(INDEX_REPO, "main", index.SIGNATURE_FILE, signature)


def test_a_stolen_key_is_revoked_through_the_index_and_clients_recover_online(
    registry, publish_as, hub_env, keys, tmp_path, monkeypatch, capsys, caplog
):
    good = publish_as("1.0.0", "publisher")
    genuine = hub_env.files(INDEX_REPO, "main")
    # The thief, holding the primary, serves an index with a huge serial; a client that fetches
    # before the revocation takes it (unavoidable: it is validly signed).
    serve_index(hub_env, keys["publisher"], 10**9, {REPO: {"1.0.0": good.commit}})
    assert get_kernel("rmsnorm", version=RANGE).origin.commit == good.commit

    # The publisher takes the hub back and revokes the primary with the backup key.
    for name, data in genuine.items():
        hub_env.tamper(INDEX_REPO, "main", name, data)
    primary, backup = keys["publisher"], str(keys["rotated"].private_path)
    argv = ["--publisher", "kernel-hub", "--registry", str(registry), "--json"]
    assert main(["index", "revoke", "ed25519:nonsense", "--sign-key", backup, *argv]) == 2
    refused = capsys.readouterr().err
    assert "not a key" in refused and primary.key_id in refused  # it names the pinned keys
    with caplog.at_level(logging.WARNING):
        assert main(["index", "revoke", primary.key_id, "--sign-key", backup, *argv]) == 0
    revocation = json.loads(capsys.readouterr().out)
    assert revocation["revoked"] == [primary.key_id] and revocation["serial"] == 2
    assert revocation["kernels"] == {}  # 1.0.0 is signed by the primary: no longer listed
    assert "no longer listed, not signed by a trusted key" in caplog.text
    fresh = publish_as("1.1.0", "rotated")  # the next genuine build, signed by the backup

    # The client's next online fetch takes the backup's index, although its serial is far below
    # the thief's, and the genuine build: nothing was deleted by hand.
    assert get_kernel("rmsnorm", version=RANGE).origin.commit == fresh.commit
    # The primary's signatures are refused from now on, cached or not, index checked or not.
    serve_index(hub_env, primary, 10**9 + 1, {REPO: {"1.0.0": good.commit}})  # no revocation
    with pytest.raises(IntegrityError, match=rf"kernel-hub's index is {REVOKED}"):
        get_kernel("rmsnorm", version=RANGE)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = yaml.safe_load(registry.read_text())
    data["publishers"]["kernel-hub"]["index"] = False  # learned revocations hold without it
    registry.write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(IntegrityError, match=rf"1\.0\.0 build/torch-cpu is {REVOKED}"):
        get_kernel("rmsnorm", version="1.0.0")  # cached before the revocation
    assert get_kernel("rmsnorm", version="1.1.0").origin.commit == fresh.commit


def test_the_thief_cannot_revoke_the_backup_key(registry, publish_as, hub_env, keys):
    good = publish_as("1.0.0", "publisher")
    listed = {REPO: {"1.0.0": good.commit}}
    serve_index(hub_env, keys["publisher"], 2, listed, revoked=[keys["rotated"].public_key])
    with pytest.raises(IntegrityError, match=r"revokes backup key .* only the registry can"):
        get_kernel("rmsnorm", version=RANGE)
    with pytest.raises(IntegrityError, match=r"revokes backup key"):  # the tools refuse too
        index.publish_index(
            "kernel-hub",
            SigningKey(keys["publisher"].private_path),
            load_registry().publishers["kernel-hub"],
            revoke=[keys["rotated"].public_key],
            vet=lambda kernels, revoked: dict(kernels),
        )
    serve_index(hub_env, keys["publisher"], 3, listed, revoked=[keys["publisher"].public_key])
    with pytest.raises(IntegrityError, match=r"revokes the key it is signed by"):
        get_kernel("rmsnorm", version=RANGE)  # nor make a revocation that never took effect
    serve_index(hub_env, keys["rotated"], 4, listed)  # the backup still signs
    assert get_kernel("rmsnorm", version=RANGE).origin.commit == good.commit


def test_a_registry_revocation_invalidates_the_cached_index_and_the_backup_publishes(
    registry, publish_as, hub_env, keys, tmp_path, monkeypatch, capsys
):
    good = publish_as("1.0.0", "publisher")
    assert get_kernel("rmsnorm", version=RANGE).origin.commit == good.commit
    revoke_in_registry(registry, keys["publisher"].public_key)  # the registry ships first
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(IntegrityError, match=rf"kernel-hub's index is {REVOKED}"):
        get_kernel("rmsnorm", version="1.0.0")  # the cached index, signed by the primary
    monkeypatch.delenv("HF_HUB_OFFLINE")
    with pytest.raises(IntegrityError, match=rf"kernel-hub's index is {REVOKED}"):
        get_kernel("rmsnorm", version=RANGE)  # the hub's, until the backup replaces it
    fresh = publish_as("1.1.0", "rotated")  # 'publish --index' with the backup key
    assert get_kernel("rmsnorm", version=RANGE).origin.commit == fresh.commit
    argv = ["index", "refresh", "--publisher", "kernel-hub", "--registry", str(registry)]
    assert main([*argv, "--sign-key", str(keys["rotated"].private_path), "--json"]) == 0
    refreshed = json.loads(capsys.readouterr().out)
    assert refreshed["serial"] == 3 and refreshed["kernels"] == {REPO: {"1.1.0": fresh.commit}}
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert get_kernel("rmsnorm", version="1.1.0").origin.commit == fresh.commit


def test_only_an_org_level_key_signs_the_org_index(
    hub_env, kernel_copy, tmp_path, keys, monkeypatch
):
    path = signed_registry(tmp_path, ["rmsnorm"], [keys["publisher"].public_key])
    data = yaml.safe_load(path.read_text())
    data["publishers"]["kernel-hub"]["index"] = True
    data["publishers"][REPO] = {"keys": [keys["stranger"].public_key]}  # one repo's own key
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    monkeypatch.setenv("KERNEL_HUB_REGISTRY", str(path))
    repo_keys = load_registry().keys_for(REPO)
    sign = keys["stranger"].private_path
    build = publish_kernel(kernel_copy("1.0.0"), REPO, sign_key=sign, index=repo_keys)
    with pytest.raises(IntegrityError, match=r"kernel-hub's index is signed by key .* not pinned"):
        get_kernel("rmsnorm", version=RANGE)
    del data["publishers"]["kernel-hub"]  # the repo entry alone asks for the index
    data["publishers"][REPO]["index"] = True
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(UntrustedSourceError, match=r"pins no key for the organisation"):
        get_kernel("rmsnorm", version=RANGE)
    serve_index(hub_env, keys["publisher"], 2, {REPO: {"1.0.0": build.commit}})
    data["publishers"]["kernel-hub"] = {"keys": [keys["publisher"].public_key]}
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    assert get_kernel("rmsnorm", version=RANGE).origin.commit == build.commit


def test_a_clock_set_back_does_not_revive_an_old_index(
    registry, publish_as, hub_env, keys, monkeypatch
):
    good = publish_as("1.0.0", "rotated")  # serial 1, by the backup, expires in 7 days
    old = hub_env.files(INDEX_REPO, "main")
    start = index.now()
    monkeypatch.setattr(index, "now", lambda: start + dt.timedelta(days=10))
    serve_index(hub_env, keys["publisher"], 2, {REPO: {"1.0.0": good.commit}})
    assert get_kernel("rmsnorm", version=RANGE).origin.commit == good.commit  # serial 2
    monkeypatch.setattr(index, "now", lambda: start + dt.timedelta(days=1))  # clock set back
    for name, data in old.items():
        hub_env.tamper(INDEX_REPO, "main", name, data)  # serial 1 replayed, "unexpired"
    with pytest.raises(IntegrityError, match=r"serial 1, .*already verified serial 2"):
        get_kernel("rmsnorm", version=RANGE)
    # The primary is revoked: serial 2 no longer binds, but the time it was accepted does.
    revoke_in_registry(registry, keys["publisher"].public_key)
    with pytest.raises(IntegrityError, match=r"has expired \(this machine's clock says .*set back"):
        get_kernel("rmsnorm", version=RANGE)
    state = json.loads(index.seen_record_path("kernel-hub").read_text())  # the index and marks
    assert state["serials"] == {keys["publisher"].key_id: 2} and state["revoked"] == []


def test_a_neighbour_who_empties_the_shared_cache_does_not_undo_a_revocation(
    registry, publish_as, hub_env, keys
):
    good = publish_as("1.0.0", "publisher")
    backup = str(keys["rotated"].private_path)
    argv = ["--publisher", "kernel-hub", "--registry", str(registry), "--json"]
    assert main(["index", "revoke", keys["publisher"].key_id, "--sign-key", backup, *argv]) == 0
    fresh = publish_as("1.1.0", "rotated")
    assert get_kernel("rmsnorm", version=RANGE).origin.commit == fresh.commit  # revocation learned
    record = index.seen_record_path("kernel-hub")
    assert record.is_file() and settings.cache_dir() not in record.parents
    # Someone who may write the shared hub cache removes everything in it; the thief, holding
    # the primary, serves an index that does not revoke it.
    shutil.rmtree(settings.cache_dir())
    serve_index(hub_env, keys["publisher"], 10**9, {REPO: {"1.0.0": good.commit}})
    with pytest.raises(IntegrityError, match=rf"kernel-hub's index is {REVOKED}"):
        get_kernel("rmsnorm", version=RANGE)
