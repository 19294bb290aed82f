"""Bad inputs and a misbehaving hub: clear errors, nothing half-written left in the cache."""

from __future__ import annotations

import pytest

from kernel_hub.errors import HubError, KernelHubError, SourceError
from kernel_hub.hub.lockfile import read_lock
from kernel_hub.hub.versions import parse_range
from kernel_hub.loading.resolver import get_kernel
from kernel_hub.registry.registry import parse_registry

from .hub_helpers import GAVE_UP_WAITS, REPO, cache_dir, publishers_yaml
from .hub_server import Fault

REGISTRY_HEAD = "schema: 1\nops:\n  rmsnorm:\n    kernel: rmsnorm\n    version: '>=1,<2'\n"
REGISTRY_TAIL = "    implementations: {cpu: [xla]}\n"


@pytest.mark.parametrize("bad", ["~~1", "=>1", "latest", "", ">= one"])
def test_malformed_version_range_says_what_is_valid(bad):
    with pytest.raises(
        KernelHubError, match=r"invalid version range .*expected e\.g\. '>=1\.2,<2'"
    ):
        parse_range(bad)


def test_version_forms():
    assert str(parse_range("1.2.0")) == "==1.2.0"
    assert parse_range(1).contains("1.9.3") and not parse_range(1).contains("2.0.0")
    assert parse_range(">=1.2,<2").contains("1.4.0")


def test_malformed_version_argument_fails_before_any_request(hub_env):
    with pytest.raises(KernelHubError, match="invalid version range '>>1'"):
        get_kernel("rmsnorm", version=">>1")
    assert hub_env.requests == []


@pytest.mark.parametrize(
    ("extra", "field", "line"),
    [
        ("    repo: kernel-hub/rmsnorm\n    commit: abc123\n", "commit", 7),
        ("    revision: v1\n", "revision", 6),
        (
            "    repo: kernel-hub/rmsnorm\n    revision: v1\n    commit: " + "a" * 40 + "\n",
            "commit",
            8,
        ),
    ],
)
def test_registry_hub_fields_are_checked_with_file_and_line(tmp_path, extra, field, line):
    path = tmp_path / "registry.yaml"
    text = REGISTRY_HEAD + extra + REGISTRY_TAIL
    with pytest.raises(SourceError, match=rf"field '{field}'") as info:
        parse_registry(path, text)
    assert info.value.line == line and info.value.path == str(path)


def test_no_matching_version_lists_existing_ones(publish, hub_env):
    publish("1.0.0")
    publish("1.1.0")
    with pytest.raises(
        HubError, match=r"no version matches >=2.*versions that exist: 1\.0\.0, 1\.1\.0"
    ):
        get_kernel("rmsnorm", version=">=2")
    with pytest.raises(
        HubError, match=r"no branch or tag 'v9'; branches: 'main', 'v1'; tags: 'v1\.0\.0'"
    ):
        get_kernel("rmsnorm", revision="v9")


def test_missing_repo_is_a_clear_404(hub_env, tmp_path, keys):
    registry = tmp_path / "registry.yaml"
    registry.write_text(
        REGISTRY_HEAD
        + "    repo: kernel-hub/missing\n"
        + REGISTRY_TAIL
        + publishers_yaml([keys["publisher"].public_key])
    )
    with pytest.raises(HubError, match="kernel-hub/missing: repository not found on http://127"):
        get_kernel("rmsnorm", registry=registry, source="hub")


def test_server_error_is_reported_with_status(publish, hub_env, retry_waits):
    publish("1.0.0")
    hub_env.inject_fault(Fault("GET", r"/refs$", status=500))
    with pytest.raises(HubError, match=rf"listing versions of {REPO}: .*answered HTTP 500"):
        get_kernel("rmsnorm", version=">=1,<2")
    assert retry_waits == GAVE_UP_WAITS


def test_file_missing_on_server_is_a_clear_error_and_leaves_nothing(publish, hub_env, tmp_path):
    new = publish("1.1.0")
    hub_env.inject_fault(Fault("GET", r"/resolve/.*/rmsnorm/layers\.py$", status=404))
    with pytest.raises(HubError, match=r"op rmsnorm: downloading kernel-hub/rmsnorm v1\.1\.0"):
        get_kernel("rmsnorm", version=">=1,<2")
    repo_cache = cache_dir(tmp_path) / "kernels--kernel-hub--rmsnorm"
    assert not (repo_cache / "snapshots" / new.commit / "build" / "torch-cpu").exists()


def test_interrupted_download_leaves_nothing_half_written(publish, hub_env, tmp_path, retry_waits):
    new = publish("1.1.0")
    fault = hub_env.inject_fault(Fault("GET", r"/resolve/.*/rmsnorm/api\.py$", truncate_at=100))
    with pytest.raises(HubError, match=r"op rmsnorm: downloading kernel-hub/rmsnorm v1\.1\.0"):
        get_kernel("rmsnorm", version=">=1,<2")
    assert retry_waits == GAVE_UP_WAITS
    repo_cache = cache_dir(tmp_path) / "kernels--kernel-hub--rmsnorm"
    assert not (repo_cache / "snapshots" / new.commit / "build" / "torch-cpu").exists()
    assert not [p for p in repo_cache.rglob("*") if p.name.endswith(".incomplete")]
    hub_env.faults.remove(fault)
    assert get_kernel("rmsnorm", version=">=1,<2").origin.commit == new.commit


def test_lock_and_override_inputs_are_checked(hub_env, tmp_path, monkeypatch):
    bad = tmp_path / "kernel-hub.lock"
    bad.write_text(
        '{"kernel-hub-lock": 1,\n "ops": {"rmsnorm": {"repo": "x/y", "commit": "abc"}}}\n'
    )
    with pytest.raises(SourceError, match=r"kernel-hub.lock:2: op 'rmsnorm': 'commit' must be"):
        read_lock(bad)
    bad.write_text("{not json")
    with pytest.raises(SourceError, match="invalid JSON"):
        get_kernel("rmsnorm")  # ./kernel-hub.lock is read when present
    assert get_kernel("rmsnorm", source="local").origin.source == "in-tree"  # but not for local
    monkeypatch.setenv("KERNEL_HUB_LOCAL_KERNELS", "rmsnorm")
    with pytest.raises(KernelHubError, match=r"KERNEL_HUB_LOCAL_KERNELS: bad entry 'rmsnorm'"):
        get_kernel("rmsnorm", lock=False)
    monkeypatch.setenv("KERNEL_HUB_SOURCE", "cloud")
    monkeypatch.delenv("KERNEL_HUB_LOCAL_KERNELS")
    with pytest.raises(
        KernelHubError, match=r"KERNEL_HUB_SOURCE='cloud'; valid values: local, hub"
    ):
        get_kernel("rmsnorm", lock=False)


def test_local_directory_overrides_load_without_network(hub_env, kernel_copy, monkeypatch):
    dev = kernel_copy("1.9.0")
    module = get_kernel("rmsnorm", local_dir=dev)
    assert module.origin.source == "local" and str(module.manifest.version) == "1.9.0"
    monkeypatch.setenv("KERNEL_HUB_LOCAL_KERNELS", f"rms_norm={dev}")
    assert get_kernel("rmsnorm").origin.path == dev
    assert hub_env.requests == []
