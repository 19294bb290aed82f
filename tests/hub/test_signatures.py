"""Signed builds: trust comes from keys pinned in the registry, never from the server.

No test here uses a lock file: each shows what the signature alone catches.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import stat

import pytest

from kernel_hub.cli import main
from kernel_hub.errors import HubError, IntegrityError, KernelHubError, SourceError
from kernel_hub.hub.signing import generate_key_pair, signature_path
from kernel_hub.loading.resolver import get_kernel
from kernel_hub.registry.registry import parse_registry

from .hub_helpers import REPO, cache_dir, signed_registry

METADATA = "build/torch-cpu/metadata.json"
API_FILE = "build/torch-cpu/rmsnorm/api.py"
SIGNATURE = signature_path("torch-cpu")


def _variant_cached(tmp_path, commit: str) -> bool:
    snapshot = cache_dir(tmp_path) / "kernels--kernel-hub--rmsnorm" / "snapshots" / commit
    return (snapshot / "build" / "torch-cpu").exists() or (snapshot / SIGNATURE).exists()


def _pin(tmp_path, monkeypatch, keys, pinned, revoked=()):
    pinned_keys = [keys[k].public_key for k in pinned]
    revoked_keys = [keys[k].public_key for k in revoked]
    path = signed_registry(tmp_path / "reg", ["rmsnorm"], pinned_keys, revoked_keys)
    monkeypatch.setenv("KERNEL_HUB_REGISTRY", str(path))


@pytest.fixture
def reg_dir(tmp_path):
    (tmp_path / "reg").mkdir()


def test_signed_build_loads_and_names_its_key(publish, hub_env, keys):
    published = publish("1.1.0")
    assert published.signed_by == keys["publisher"].key_id
    module = get_kernel("rmsnorm", version=">=1,<2")
    assert module.origin.commit == published.commit


def test_file_and_digest_rewritten_on_server_fail_the_signature(publish, hub_env, tmp_path):
    new = publish("1.1.0")
    files = hub_env.files(REPO, new.commit)
    evil = files[API_FILE] + b"\nimport os  # injected\n"
    metadata = json.loads(files[METADATA])
    metadata["digest"]["files"]["rmsnorm/api.py"] = base64.b64encode(
        hashlib.sha256(evil).digest()
    ).decode()
    hub_env.tamper(REPO, new.commit, API_FILE, evil)
    hub_env.tamper(REPO, new.commit, METADATA, json.dumps(metadata).encode())
    with pytest.raises(IntegrityError, match="does not verify") as info:
        get_kernel("rmsnorm", version=">=1,<2")
    message = str(info.value)
    assert REPO in message and "1.1.0" in message and "Nothing of it was kept" in message
    assert not _variant_cached(tmp_path, new.commit)


def test_build_re_signed_by_an_unpinned_key_is_refused(publish, hub_env, tmp_path, keys):
    new = publish("1.1.0", key="stranger")
    with pytest.raises(IntegrityError) as info:
        get_kernel("rmsnorm", version="1.1.0")
    message = str(info.value)
    assert f"signed by key {keys['stranger'].key_id}, which is not pinned" in message
    assert keys["publisher"].key_id in message  # what is pinned
    assert not _variant_cached(tmp_path, new.commit)


def test_unsigned_build_is_refused(publish, hub_env, tmp_path):
    new = publish("1.1.0", key=None)
    assert new.signed_by is None
    with pytest.raises(IntegrityError, match="the build is not signed"):
        get_kernel("rmsnorm", version="1.1.0")
    assert not _variant_cached(tmp_path, new.commit)


def test_rotated_in_key_is_accepted(publish, hub_env, tmp_path, monkeypatch, keys, reg_dir):
    _pin(tmp_path, monkeypatch, keys, ["publisher", "rotated"])
    old = publish("1.0.0")  # signed by the old key
    new = publish("1.1.0", key="rotated")
    assert get_kernel("rmsnorm", version="1.1.0").origin.commit == new.commit
    assert get_kernel("rmsnorm", version="1.0.0").origin.commit == old.commit


def test_revoked_key_is_refused_also_from_the_offline_cache(
    publish, hub_env, tmp_path, monkeypatch, keys, reg_dir
):
    old = publish("1.0.0")
    assert get_kernel("rmsnorm", version="1.0.0").origin.commit == old.commit  # cached now
    hub_env.stop()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _pin(tmp_path, monkeypatch, keys, ["rotated"], revoked=["publisher"])
    with pytest.raises(IntegrityError, match=r"lists as revoked") as info:
        get_kernel("rmsnorm", version="1.0.0")
    assert keys["publisher"].key_id in str(info.value)
    assert not _variant_cached(tmp_path, old.commit)


def test_signature_of_another_repo_or_version_is_refused(publish, hub_env):
    other = publish("1.0.0", repo="kernel-hub/rmsnorm-twin")
    new = publish("1.1.0")
    # The same publisher's valid signature and metadata, served for another repo and version.
    twin = hub_env.files("kernel-hub/rmsnorm-twin", other.commit)
    for path in [p for p in twin if p.startswith("build/torch-cpu/")] + [SIGNATURE]:
        hub_env.tamper(REPO, new.commit, path, twin[path])
    with pytest.raises(IntegrityError, match=r"made for repo 'kernel-hub/rmsnorm-twin'"):
        get_kernel("rmsnorm", revision=new.commit)


def test_older_signed_build_served_as_a_newer_tag_is_refused(publish, hub_env):
    old = publish("1.0.0")
    new = publish("1.1.0")
    previous = hub_env.files(REPO, old.commit)
    for path in [p for p in previous if p.startswith("build/torch-cpu/")] + [SIGNATURE]:
        hub_env.tamper(REPO, new.commit, path, previous[path])
    # validly signed by the pinned key, for this repo: only the tag says it is not 1.1.0
    with pytest.raises(IntegrityError, match=r"tag v1\.1\.0 holds a build of version 1\.0\.0"):
        get_kernel("rmsnorm", version="1.1.0")


def test_no_pinned_key_is_refused_before_any_request(
    publish, hub_env, tmp_path, monkeypatch, reg_dir
):
    publish("1.1.0")
    _pin(tmp_path, monkeypatch, {}, [])
    before = len(hub_env.requests)
    with pytest.raises(KernelHubError, match=r"pins no signing key for kernel-hub/rmsnorm"):
        get_kernel("rmsnorm", version="1.1.0")
    assert len(hub_env.requests) == before


def test_keygen_writes_a_private_key_only_its_owner_reads(tmp_path, capsys):
    out = tmp_path / "keys" / "publisher.key"
    out.parent.mkdir()
    assert main(["keygen", "--out", str(out), "--publisher", "my-org"]) == 0
    printed = capsys.readouterr().out
    public = (tmp_path / "keys" / "publisher.key.pub").read_text().strip()
    assert public.startswith("ed25519:") and f"keys: [{public}]" in printed
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o600
    assert b"PRIVATE KEY" in out.read_bytes()
    assert main(["keygen", "--out", str(out)]) == 2
    assert "refusing to overwrite" in capsys.readouterr().err
    registry = f"schema: 1\nops: {{}}\npublishers:\n  my-org:\n    keys: [{public}]\n"
    assert parse_registry(tmp_path / "r.yaml", registry).keys_for("my-org/x").keys == (public,)


def test_keygen_pins_the_key_in_a_registry_before_its_ops(tmp_path, capsys):
    registry = tmp_path / "registry.yaml"
    registry.write_text("schema: 1\n# the ops\nops:\n  x:\n    kernel: x\n    version: '>=1'\n")
    out = tmp_path / "publisher.key"
    assert main(["keygen", "--out", str(out), "--pin", str(registry)]) == 2
    assert "--pin needs --publisher" in capsys.readouterr().err and not out.exists()
    assert main(["keygen", "--out", str(out), "--publisher", "my-org", "--pin", str(registry)]) == 0
    public = (tmp_path / "publisher.key.pub").read_text().strip()
    text = registry.read_text()
    assert text.index("publishers:") < text.index("ops:")  # ops stay last for new-kernel
    assert parse_registry(registry).keys_for("my-org/x").keys == (public,)
    again = tmp_path / "second.key"
    assert main(["keygen", "--out", str(again), "--publisher", "b", "--pin", str(registry)]) == 2
    assert "already has a publishers: section" in capsys.readouterr().err
    assert not again.exists() and registry.read_text() == text


def test_publish_needs_a_key_or_an_explicit_unsigned(hub_env, kernel_copy, capsys):
    with pytest.raises(SystemExit):
        main(["publish", str(kernel_copy("1.0.0")), "--repo", REPO])
    assert "--sign-key" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("section", "line", "expected"),
    [
        ("  kernel-hub:\n    keys: [ed25519:AAAA]\n", 5, r"has 32 bytes, 'ed25519:AAAA' has 3"),
        ("  kernel-hub:\n    keys: [rsa:xyz]\n", 5, r"field 'keys': expected 'ed25519:'"),
        ("  kernel-hub:\n    keys: [K]\n    revoked: [K]\n", 6, r"both pinned and revoked"),
        ("  kernel-hub:\n    key: [K]\n", 5, r"unknown field 'key'; valid fields: backup, index"),
        ("  a/b/c:\n    keys: [K]\n", 4, r"'a/b/c' is not a hub organisation"),
    ],
)
def test_bad_publisher_keys_name_file_line_and_field(tmp_path, section, line, expected):
    key = generate_key_pair(tmp_path / "k").public_key
    text = "schema: 1\nops: {}\npublishers:\n" + section.replace("K", key)
    with pytest.raises(SourceError, match=expected) as info:
        parse_registry(tmp_path / "registry.yaml", text)
    assert info.value.line == line and info.value.path == str(tmp_path / "registry.yaml")


def test_registry_without_publishers_reads_as_before(tmp_path):
    assert parse_registry(tmp_path / "r.yaml", "schema: 1\nops: {}\n").publishers == {}


def test_offline_load_of_a_verified_build_checks_the_signature_again(
    publish, hub_env, tmp_path, monkeypatch
):
    new = publish("1.1.0")
    get_kernel("rmsnorm", version="1.1.0")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    snapshot = cache_dir(tmp_path) / "kernels--kernel-hub--rmsnorm" / "snapshots" / new.commit
    (snapshot / SIGNATURE).unlink()
    with pytest.raises(IntegrityError, match="not signed"):
        get_kernel("rmsnorm", version="1.1.0")
    with pytest.raises(HubError, match=r"not in the cache|no cached build"):
        get_kernel("rmsnorm", version="1.1.0")
