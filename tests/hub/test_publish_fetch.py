"""build -> publish v1.0.0 and v1.1.0 -> get_kernel by range, by lock, by revision, side by side."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kernel_hub.errors import HubError
from kernel_hub.hub.locking import lock_registry
from kernel_hub.loading.resolver import get_kernel
from kernel_hub.registry.registry import load_registry

from .hub_helpers import REPO, cache_dir, publishers_yaml


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def test_publish_tags_versions_and_moves_major_branch(publish, hub_env):
    first = publish("1.0.0")
    assert first.tag == "v1.0.0" and first.branch == "v1"
    second = publish("1.1.0")
    assert hub_env.tags(REPO) == {"v1.0.0": first.commit, "v1.1.0": second.commit}
    assert hub_env.branches(REPO)["v1"] == second.commit
    # Each commit holds exactly one build: the 1.1.0 commit kept no 1.0.0 files behind.
    files = hub_env.files(REPO, second.commit)
    assert b"version: 1.1.0" in files["build/torch-cpu/kernel.yaml"]
    assert sorted({p.split("/")[1] for p in files if p.startswith("build/")}) == [
        "torch-cpu",
        "torch-tpu",
    ]
    # A back-ported older version gets its tag but does not move v1 backwards.
    backport = publish("1.0.5")
    assert backport.branch is None and hub_env.branches(REPO)["v1"] == second.commit


def test_republishing_a_version_is_refused(publish, hub_env):
    first = publish("1.0.0")
    with pytest.raises(HubError, match=r"1\.0\.0 is already published .*bump 'version'"):
        publish("1.0.0")
    assert hub_env.tags(REPO) == {"v1.0.0": first.commit}


def test_range_loads_newest_lock_loads_pinned_side_by_side(publish, hub_env, tmp_path):
    old = publish("1.0.0")
    lock = lock_registry(load_registry(), tmp_path / "kernel-hub.lock").lock
    assert lock.ops["rmsnorm"].commit == old.commit
    new = publish("1.1.0")

    newest = get_kernel("rmsnorm", version=">=1,<2", lock=False)
    assert str(newest.manifest.version) == "1.1.0"
    assert newest.origin.commit == new.commit and newest.origin.variant == "torch-cpu"
    pinned = get_kernel("rmsnorm")  # ./kernel-hub.lock (cwd) pins 1.0.0 and selects the hub
    assert str(pinned.manifest.version) == "1.0.0" and pinned.origin.commit == old.commit

    assert newest is not pinned and newest.__name__ != pinned.__name__
    assert newest.rms_norm is not pinned.rms_norm
    x, weight = torch.randn(4, 32), torch.rand(32)
    expected = reference_rms_norm(x, weight)
    for module in (newest, pinned):
        torch.testing.assert_close(module.rms_norm(x, weight), expected, rtol=1e-5, atol=1e-5)

    # get_kernel downloaded only the variant for this (CPU) machine; locking fetched all of 1.0.0.
    build = (
        cache_dir(tmp_path) / "kernels--kernel-hub--rmsnorm" / "snapshots" / new.commit / "build"
    )
    assert sorted(p.name for p in build.iterdir()) == ["torch-cpu"]


def test_revision_tag_commit_and_registry_pin(publish, hub_env, tmp_path, keys):
    old = publish("1.0.0")
    publish("1.1.0")
    assert get_kernel("rmsnorm", revision="v1.0.0").origin.commit == old.commit
    assert get_kernel("rmsnorm", revision=old.commit).origin.commit == old.commit
    assert str(get_kernel("rmsnorm", revision="v1").manifest.version) == "1.1.0"
    registry = tmp_path / "registry.yaml"
    registry.write_text(
        "schema: 1\nops:\n  rmsnorm:\n    kernel: rmsnorm\n    repo: kernel-hub/rmsnorm\n"
        f"    version: '>=1,<2'\n    commit: {old.commit}\n"
        "    implementations: {cpu: [xla]}\n    layers: [RMSNorm]\n"
        + publishers_yaml([keys["publisher"].public_key])
    )
    module = get_kernel("rmsnorm", registry=registry, source="hub")
    assert module.origin.commit == old.commit


def test_plain_get_kernel_stays_in_tree_without_network(publish, hub_env):
    publish("1.1.0")
    before = len(hub_env.requests)
    module = get_kernel("rmsnorm")
    assert module.origin.source == "in-tree"
    assert len(hub_env.requests) == before


def test_hugging_face_kernels_fetches_published_major_version(
    publish, hub_env, tmp_path, monkeypatch
):
    import kernels
    from huggingface_hub import constants

    publish("1.0.0")
    new = publish("1.1.0")
    # kernels downloads into huggingface_hub's import-time cache unless told otherwise.
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "kernels-cache"))
    # kernels 0.17.2 builds an invalid User-Agent header when telemetry is off; its telemetry
    # requests go to constants.ENDPOINT, which hub_env points at the local server.
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", False)
    module = kernels.get_kernel(REPO, version=1, trust_remote_code=True)  # branch v1 -> 1.1.0
    assert f"snapshots/{new.commit}/build/torch-cpu/" in module.__file__
    x, weight = torch.randn(2, 8), torch.rand(8)
    torch.testing.assert_close(
        module.rms_norm(x, weight), reference_rms_norm(x, weight), rtol=1e-5, atol=1e-5
    )


_FIRST_THING_A_PROCESS_DOES = """
import jax
from kernel_hub import get_kernel
get_kernel("rmsnorm", version="1.1.0")
print("async dispatch:", jax.config.read("jax_cpu_enable_async_dispatch"))
"""


def test_hub_load_first_keeps_the_bridge_thread_policy(publish, hub_env):
    """Fetching asks JAX for the platform; kernel-hub's inline thread policy (and with it the
    staging buffers) must still apply when a hub load is the first thing a process does."""
    publish("1.1.0")
    result = subprocess.run(
        [sys.executable, "-P", "-c", _FIRST_THING_A_PROCESS_DOES],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert result.stdout.strip().splitlines()[-1:] == ["async dispatch: False"], result.stderr
