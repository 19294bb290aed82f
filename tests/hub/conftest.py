"""Fixtures: the product's hub server on 127.0.0.1, signing keys made at test time, and an
environment that points everything at them.

``huggingface_hub`` reads ``HF_ENDPOINT``, ``HF_HUB_CACHE`` and ``HF_HUB_OFFLINE`` when it is
imported, which has already happened in a pytest process. kernel-hub reads them at call time and
passes endpoint, cache and offline mode to ``huggingface_hub`` explicitly
(kernel_hub/hub/settings.py), so setting the environment variables is enough for kernel-hub's own
calls. ``huggingface_hub`` also
makes calls of its own to ``constants.ENDPOINT`` (its agent-detection registry, when building the
User-Agent): the ``hub_env`` fixture therefore also points ``constants.ENDPOINT`` and the URL
template at the local server and turns telemetry off, so no test can reach the internet.
"""

from __future__ import annotations

import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kernel_hub.hub.signing import KeyPair, generate_key_pair
from kernel_hub.registry.publisher_keys import PublisherKeys

from .hub_helpers import REPO, RMSNORM, cache_dir, signed_registry
from .hub_server import WRITE_TOKEN, TestHub


@pytest.fixture(scope="session")
def keys(tmp_path_factory) -> dict[str, KeyPair]:
    """Key pairs made for this test run (no private key is ever committed): ``publisher`` (pinned
    in the test registry), ``rotated`` (a second key to rotate to), ``stranger`` (never pinned)."""
    folder = tmp_path_factory.mktemp("keys")
    return {name: generate_key_pair(folder / name) for name in ("publisher", "rotated", "stranger")}


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[TestHub]:
    with TestHub(tmp_path / "hub-store") as server:
        yield server


@pytest.fixture
def hub_env(
    hub: TestHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, keys: dict[str, KeyPair]
) -> TestHub:
    from huggingface_hub import constants

    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache_dir(tmp_path)))
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.setenv("KERNEL_HUB_STATE_DIR", str(tmp_path / "kernel-hub-state"))
    monkeypatch.setenv("HF_TOKEN", WRITE_TOKEN)  # publishing needs the server's write token
    for name in (
        "HF_HUB_OFFLINE",
        "KERNEL_HUB_SOURCE",
        "KERNEL_HUB_LOCAL_KERNELS",
        "KERNEL_HUB_LOCK",
        "KERNEL_HUB_TRUSTED_PUBLISHERS",
        "KERNEL_HUB_VARIANT",
    ):
        monkeypatch.delenv(name, raising=False)
    registry = signed_registry(tmp_path, ["rmsnorm"], [keys["publisher"].public_key])
    monkeypatch.setenv("KERNEL_HUB_REGISTRY", str(registry))
    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(
        constants,
        "HUGGINGFACE_CO_URL_TEMPLATE",
        hub.url + "/{repo_id}/resolve/{revision}/{filename}",
    )
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", True)
    # online, as the environment above says: huggingface_hub's request hook reads the offline flag
    # it took at import, which an earlier test that set HF_HUB_OFFLINE=1 may have frozen to True
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.chdir(tmp_path)  # no stray ./kernel-hub.lock is picked up
    return hub


@pytest.fixture
def retry_waits(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The waits kernel-hub's hub client takes between retries (kernel_hub/hub/network.py),
    recorded here instead of slept: a test that lets every try fail asserts the backoff it
    would have waited (1 + 2 + 4 + 8 s) without spending it. Everything else on the module's
    clock (``monotonic``: the fetch deadline) is the real one."""
    from kernel_hub.hub import network

    waits: list[float] = []

    class Clock:
        def __getattr__(self, name: str):
            return getattr(time, name)

        def sleep(self, seconds: float) -> None:
            waits.append(seconds)

    monkeypatch.setattr(network, "time", Clock())
    return waits


@pytest.fixture
def kernel_copy(tmp_path: Path):
    """``kernel_copy("1.1.0")``: rmsnorm copied to a tmp dir, with that manifest version."""

    def make(version: str) -> Path:
        (tmp_path / "src").mkdir(exist_ok=True)
        dest = Path(tempfile.mkdtemp(prefix=f"{version}-", dir=tmp_path / "src")) / "rmsnorm"
        shutil.copytree(RMSNORM, dest, ignore=shutil.ignore_patterns("__pycache__", "build"))
        manifest = dest / "kernel.yaml"
        text, count = re.subn(r"(?m)^version: .*$", f"version: {version}", manifest.read_text())
        assert count == 1, "rmsnorm's kernel.yaml has one version line"
        manifest.write_text(text)
        return dest

    return make


@pytest.fixture
def publish(hub_env: TestHub, kernel_copy, keys):
    """``publish("1.1.0", repo=..., key=...)``: publish a copy of rmsnorm at that version, signed
    by the pinned test key unless another key name (or None: unsigned) is given; ``index=True``
    also adds it to the publisher's signed index."""
    from kernel_hub.hub.publish import publish_kernel

    def run(version: str, repo: str = REPO, key: str | None = "publisher", index: bool = False):
        sign_key = keys[key].private_path if key is not None else None
        org = repo.split("/")[0]
        trusted = PublisherKeys(org, (keys["publisher"].public_key,)) if index else None
        return publish_kernel(kernel_copy(version), repo, sign_key=sign_key, index=trusted)

    return run
