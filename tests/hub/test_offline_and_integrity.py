"""Offline resolution from the cache; tampered, escaping and untrusted builds are refused."""

from __future__ import annotations

import base64
import hashlib
import json

import pytest
from packaging.specifiers import SpecifierSet

from kernel_hub.errors import HubError, IntegrityError, UntrustedSourceError
from kernel_hub.hub.locking import lock_registry
from kernel_hub.loading.resolver import get_kernel
from kernel_hub.registry.registry import load_registry

from .hub_helpers import REPO, cache_dir, publishers_yaml

API_FILE = "build/torch-cpu/rmsnorm/api.py"


def snapshot_variant(tmp_path, commit: str):
    return (
        cache_dir(tmp_path)
        / "kernels--kernel-hub--rmsnorm"
        / "snapshots"
        / commit
        / "build"
        / "torch-cpu"
    )


def test_offline_after_one_fetch_works_with_server_stopped(publish, hub_env, monkeypatch, tmp_path):
    publish("1.0.0")
    new = publish("1.1.0")
    online = get_kernel("rmsnorm", version=">=1,<2")
    lock_path = tmp_path / "pinned.lock"
    lock_registry(load_registry(), lock_path)
    hub_env.stop()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    offline = get_kernel("rmsnorm", version=">=1,<2")
    assert offline is online and offline.origin.commit == new.commit
    assert get_kernel("rmsnorm", revision="v1.1.0").origin.commit == new.commit
    assert get_kernel("rmsnorm", lock=lock_path).origin.commit == new.commit


def test_offline_with_empty_cache_names_op_and_version(publish, hub_env, monkeypatch):
    publish("1.0.0")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    before = len(hub_env.requests)
    with pytest.raises(HubError) as info:
        get_kernel("rms_norm", version=">=1.0,<2")
    message = str(info.value)
    assert "op rmsnorm" in message and "cached versions: none" in message
    assert str(SpecifierSet(">=1.0,<2")) in message
    assert "HF_HUB_OFFLINE" in message
    assert len(hub_env.requests) == before  # no network call


def test_file_changed_after_locking_is_refused_and_not_kept(
    publish, hub_env, tmp_path, monkeypatch
):
    old = publish("1.0.0")
    lock_path = tmp_path / "pinned.lock"
    lock_registry(load_registry(), lock_path)
    original = hub_env.files(REPO, old.commit)[API_FILE]
    hub_env.tamper(REPO, old.commit, API_FILE, original + b"\nimport os  # injected\n")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "fresh-cache"))  # nothing cached yet
    with pytest.raises(IntegrityError, match=rf"changed: {API_FILE}") as info:
        get_kernel("rmsnorm", lock=lock_path)
    assert "Nothing of it was kept" in str(info.value)
    snapshot = tmp_path / "fresh-cache" / "kernels--kernel-hub--rmsnorm" / "snapshots" / old.commit
    assert not (snapshot / "build" / "torch-cpu").exists()
    # And nothing importable is left for an offline retry either.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubError, match="not in the cache"):
        get_kernel("rmsnorm", lock=lock_path)


def test_lock_covers_metadata_when_digest_is_rewritten_too(publish, hub_env, tmp_path, monkeypatch):
    old = publish("1.0.0")
    lock_path = tmp_path / "pinned.lock"
    lock_registry(load_registry(), lock_path)
    files = hub_env.files(REPO, old.commit)
    evil = files[API_FILE] + b"\n# changed\n"
    metadata = json.loads(files["build/torch-cpu/metadata.json"])
    metadata["digest"]["files"]["rmsnorm/api.py"] = base64.b64encode(
        hashlib.sha256(evil).digest()
    ).decode()
    hub_env.tamper(REPO, old.commit, API_FILE, evil)
    hub_env.tamper(REPO, old.commit, "build/torch-cpu/metadata.json", json.dumps(metadata).encode())
    # Locking cached the original bytes; a fresh cache makes get_kernel download the tampered ones.
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "fresh-cache"))
    downloaded = len(hub_env.downloads("rmsnorm/api.py"))
    with pytest.raises(IntegrityError, match=r"changed: build/torch-cpu/metadata\.json"):
        get_kernel("rmsnorm", lock=lock_path)
    # refused on metadata.json, before the changed file is even downloaded
    assert len(hub_env.downloads("rmsnorm/api.py")) == downloaded


def test_digest_mismatch_without_lock_leaves_nothing_importable(publish, hub_env, tmp_path):
    new = publish("1.1.0")
    hub_env.tamper(REPO, new.commit, API_FILE, b"raise SystemExit('tampered')\n")
    with pytest.raises(IntegrityError, match=rf"changed: {API_FILE}"):
        get_kernel("rmsnorm", version=">=1,<2")
    variant = snapshot_variant(tmp_path, new.commit)
    assert not variant.exists()
    blobs = cache_dir(tmp_path) / "kernels--kernel-hub--rmsnorm" / "blobs"
    assert not list(blobs.glob("*.incomplete"))


def test_cache_modified_after_download_is_refused(publish, hub_env, tmp_path):
    new = publish("1.1.0")
    get_kernel("rmsnorm", version="1.1.0")
    target = (snapshot_variant(tmp_path, new.commit) / "rmsnorm" / "layers.py").resolve()
    target.write_text(target.read_text() + "\n# edited in the cache\n")
    with pytest.raises(IntegrityError, match=r"changed: build/torch-cpu/rmsnorm/layers\.py"):
        get_kernel("rmsnorm", version="1.1.0")


def test_file_name_escaping_the_build_folder_is_refused(publish, hub_env):
    new = publish("1.1.0")
    hub_env.tamper(REPO, new.commit, "build/torch-cpu/../../outside.py", b"print('escaped')\n")
    with pytest.raises(IntegrityError, match=r"escapes"):
        get_kernel("rmsnorm", version=">=1,<2")


def test_untrusted_publisher_refused_unless_trusted(publish, hub_env, tmp_path, monkeypatch, keys):
    other = "someone-else/rmsnorm"
    publish("1.1.0", repo=other, key="stranger")
    registry = tmp_path / "registry.yaml"
    registry.write_text(
        "schema: 1\nops:\n  rmsnorm:\n    kernel: rmsnorm\n    repo: someone-else/rmsnorm\n"
        "    version: '>=1,<2'\n    implementations: {cpu: [xla]}\n    layers: [RMSNorm]\n"
        + publishers_yaml([keys["stranger"].public_key], org="someone-else")
    )
    before = len(hub_env.requests)
    with pytest.raises(UntrustedSourceError, match=r"'someone-else'.*not a trusted publisher"):
        get_kernel("rmsnorm", registry=registry, source="hub")
    assert len(hub_env.requests) == before  # refused before any download
    assert get_kernel("rmsnorm", registry=registry, source="hub", trust_remote_code=[other])
    assert get_kernel("rmsnorm", registry=registry, source="hub", trust_remote_code=True)
    monkeypatch.setenv("KERNEL_HUB_TRUSTED_PUBLISHERS", "someone-else")
    assert get_kernel("rmsnorm", registry=registry, source="hub").origin.repo == other
