"""``kernel-hub mirror`` + ``kernel-hub serve``: an air-gapped pod loads verified builds from a
mirror exactly as from the hub."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kernel_hub.cli import main
from kernel_hub.errors import KernelHubError
from kernel_hub.hub.locking import lock_registry
from kernel_hub.hub.publish import publish_kernel
from kernel_hub.hub.store import RepoStore, StoreError
from kernel_hub.loading.resolver import get_kernel
from kernel_hub.paths import kernels_dir
from kernel_hub.registry.registry import load_registry

from .hub_helpers import GAVE_UP_WAITS, REPO, signed_registry
from .hub_server import TestHub

API_FILE = "build/torch-cpu/rmsnorm/api.py"


def point_at(monkeypatch, url: str, cache: Path) -> None:
    """Send kernel-hub and huggingface_hub to ``url`` with an empty cache, as a fresh pod."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_ENDPOINT", url)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "ENDPOINT", url)
    monkeypatch.setattr(
        constants, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}"
    )


def mirror_json(capsys, *argv: str) -> dict:
    assert main(["mirror", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture
def served(tmp_path):
    """``kernel-hub serve DIR --port 0`` as its own process; yields (url, process)."""
    processes = []

    def start(directory: Path) -> str:
        process = subprocess.Popen(
            [sys.executable, "-P", "-m", "kernel_hub.cli", "serve", str(directory), "--port", "0"],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
        processes.append(process)
        line = process.stdout.readline()
        assert line.startswith("serving "), line
        return line.split(" at ", 1)[1].split()[0]

    yield start
    for process in processes:
        process.terminate()
        process.wait(timeout=30)


@pytest.mark.slow
def test_every_registry_op_and_the_demo_load_verified_from_the_mirror(
    hub_env, tmp_path, monkeypatch, keys, capsys, served
):
    ops = ["rmsnorm", "attention", "moe-gemm"]
    (tmp_path / "reg").mkdir()
    registry = signed_registry(tmp_path / "reg", ops, [keys["publisher"].public_key])
    monkeypatch.setenv("KERNEL_HUB_REGISTRY", str(registry))
    published = {}
    for entry in load_registry():
        published[entry.name] = publish_kernel(
            kernels_dir() / entry.kernel,
            entry.repo,
            sign_key=keys["publisher"].private_path,
            build_dir=tmp_path / "builds" / entry.name,
        ).commit

    mirrored = mirror_json(capsys, "--to", str(tmp_path / "mirror"))
    assert {b["op"]: b["commit"] for b in mirrored["builds"]} == published
    assert all(b["variants"] == ["torch-cpu", "torch-tpu"] for b in mirrored["builds"])
    hub_env.stop()  # from here on only the mirror answers

    url = served(tmp_path / "mirror")
    point_at(monkeypatch, url, tmp_path / "pod-cache")
    for op, commit in published.items():
        module = get_kernel(op, source="hub")
        assert (module.origin.source, module.origin.commit) == ("hub", commit)

    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(sys.path),
        "HF_HUB_CACHE": str(tmp_path / "demo-cache"),
        "KERNEL_HUB_SOURCE": "hub",  # every kernel from the mirror, none in-tree
        "KERNEL_HUB_KERNELS_DIR": str(tmp_path / "no-in-tree-kernels"),
    }
    demo = subprocess.run(
        [
            sys.executable,
            "-P",
            "-m",
            "kernel_hub.cli",
            "demo",
            "--model",
            "mixtral",
            "--no-hub",
            "--json",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert demo.returncode == 0, demo.stderr[-3000:]
    rows = json.loads(demo.stdout)
    assert len(rows) == 1, (rows, demo.stderr[-3000:])
    (row,) = rows
    assert row["ok"] and row["greedy_identical"], row
    assert set(row["swapped"]) == {"RMSNorm", "AttentionInterface", "ExpertsInterface"}
    snapshots = tmp_path / "demo-cache"
    assert sorted(p.name for p in snapshots.glob("kernels--*")) == [
        "kernels--kernel-hub--attention",
        "kernels--kernel-hub--moe-gemm",
        "kernels--kernel-hub--rmsnorm",
    ]


def test_mirror_refuses_what_its_clients_would_refuse(publish, hub_env, tmp_path, capsys):
    new = publish("1.1.0")
    files = hub_env.files(REPO, new.commit)
    hub_env.tamper(REPO, new.commit, API_FILE, files[API_FILE] + b"\n# changed\n")
    assert main(["mirror", "--to", str(tmp_path / "mirror")]) == 2
    assert "changed: build/torch-cpu/rmsnorm/api.py" in capsys.readouterr().err
    assert RepoStore(tmp_path / "mirror").repos() == []


def test_mirror_of_a_lock_serves_it_and_takes_new_publications(
    publish, hub_env, tmp_path, monkeypatch, capsys, keys, kernel_copy
):
    old = publish("1.0.0")
    lock = tmp_path / "pinned.lock"
    lock_registry(load_registry(), lock)
    publish("1.1.0")
    mirrored = mirror_json(capsys, "--to", str(tmp_path / "mirror"), "--lock", str(lock))
    assert [(b["commit"], b["refs"]) for b in mirrored["builds"]] == [(old.commit, ["v1.0.0"])]
    again = mirror_json(capsys, "--to", str(tmp_path / "mirror"), "--lock", str(lock))
    assert [b["copied"] for b in again["builds"]] == [False]
    hub_env.stop()

    with TestHub(tmp_path / "mirror") as mirror:
        point_at(monkeypatch, mirror.url, tmp_path / "pod-cache")
        assert get_kernel("rmsnorm", lock=lock).origin.commit == old.commit  # same commit ids
        newer = publish_kernel(kernel_copy("1.2.0"), REPO, sign_key=keys["publisher"].private_path)
        assert mirror.tags(REPO) == {"v1.0.0": old.commit, "v1.2.0": newer.commit}
        module = get_kernel("rmsnorm", version=">=1,<2", lock=False)
        assert (str(module.manifest.version), module.origin.commit) == ("1.2.0", newer.commit)


def test_a_publisher_index_is_mirrored_and_checked_behind_the_mirror(
    publish, hub_env, tmp_path, monkeypatch, keys
):
    registry = signed_registry(tmp_path, ["rmsnorm"], [keys["publisher"].public_key])
    data = yaml.safe_load(registry.read_text())
    data["publishers"]["kernel-hub"]["index"] = True
    registry.write_text(yaml.safe_dump(data, sort_keys=False))
    publish("1.0.0", index=True)
    new = publish("1.1.0", index=True)
    from kernel_hub.hub.mirror import mirror_registry

    mirror_registry(load_registry(), tmp_path / "mirror")
    hub_env.stop()
    with TestHub(tmp_path / "mirror") as mirror:
        point_at(monkeypatch, mirror.url, tmp_path / "pod-cache")
        assert get_kernel("rmsnorm", version=">=1,<2").origin.commit == new.commit
        mirror.store.set_ref("kernel", REPO, "tag", "v1.1.0", None, create=False)  # frozen
        with pytest.raises(KernelHubError, match=r"lists 1\.1\.0 as the newest"):
            get_kernel("rmsnorm", version=">=1,<2")


def test_mirror_blob_changed_on_disk_is_not_served(
    publish, hub_env, tmp_path, monkeypatch, retry_waits
):
    publish("1.1.0")
    from kernel_hub.hub.mirror import mirror_registry

    mirror_registry(load_registry(), tmp_path / "mirror")
    hub_env.stop()
    store = RepoStore(tmp_path / "mirror")
    commit = store.resolve("kernel", REPO, "v1.1.0")
    blob = tmp_path / "mirror" / "blobs" / commit.files[API_FILE].sha256
    blob.write_bytes(blob.read_bytes() + b"# bit rot\n")
    with TestHub(tmp_path / "mirror") as mirror:
        point_at(monkeypatch, mirror.url, tmp_path / "pod-cache")
        with pytest.raises(KernelHubError, match=r"answered HTTP 500"):
            get_kernel("rmsnorm", version="1.1.0")
        assert retry_waits == GAVE_UP_WAITS  # the mirror refuses the blob on every try


def test_serve_refuses_a_folder_that_is_not_a_store(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "notes.txt").write_text("mine")
    with pytest.raises(KernelHubError, match=r"neither empty nor a kernel-hub store"):
        RepoStore(tmp_path / "data")
    with pytest.raises(StoreError, match=r"invalid repo id"):
        RepoStore(tmp_path / "store").repo_dir("kernel", "../../etc")


def test_mirror_copies_the_bytes_it_verified_not_the_cache_again(publish, hub_env, tmp_path):
    """A cached file swapped right after it was verified does not reach the mirror: the store is
    written from the process's private copy of the bytes hashed, and the signature bytes checked."""
    from kernel_hub.hub import fetch
    from kernel_hub.hub.mirror import mirror_registry

    new = publish("1.1.0")
    genuine = hub_env.files(REPO, new.commit)
    real_hash_tree = fetch.hash_tree

    def swap_after_hashing(root, **kwargs):
        digests = real_hash_tree(root, **kwargs)
        if "snapshots" in Path(root).parts:
            (Path(root) / "rmsnorm" / "api.py").write_bytes(b"# swapped after the check\n")
            (Path(root).parent.parent / "signatures" / "torch-cpu.sig").write_bytes(b"{}")
        return digests

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fetch, "hash_tree", swap_after_hashing)
        mirror_registry(load_registry(), tmp_path / "mirror")
    store = RepoStore(tmp_path / "mirror")
    commit = store.resolve("kernel", REPO, "v1.1.0")
    served = {path: store.read_blob(entry) for path, entry in commit.files.items()}
    assert "build/torch-cpu/rmsnorm/api.py" in served and "signatures/torch-cpu.sig" in served
    assert served == {path: genuine[path] for path in served}
