"""The hub half of ``kernel-hub demo``, offline on 127.0.0.1.

What a publisher and a user do with a real hub (docs/hub-walkthrough.md), against a ``kernel-hub
serve`` store in a temporary directory: an ephemeral publisher key; every in-tree kernel built and
published as signed builds; a registry pinning that key; each op fetched with ``huggingface_hub``
into a fresh cache, its signature and digests verified, loaded by version range. The demo then
kernelizes its models with those builds (``kernel_mapping`` of each op to its range). A kernel
that cannot be built as a hub build is reported with the reason and runs in-tree.

Only public entry points are used (``publish_kernel``, ``serve``, ``get_kernel(registry=...)``).
``huggingface_hub`` reads ``HF_ENDPOINT`` when first imported, so ``local_hub`` must be entered
before anything imports it (the CLI imports it lazily): then no request leaves 127.0.0.1.
"""

from __future__ import annotations

import os
import secrets
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kernel_hub.errors import KernelHubError

ORG = "kernel-hub-demo"
"""The demo publisher's organisation on the local hub."""


@dataclass(frozen=True)
class HubBuild:
    op: str
    repo: str
    version: str
    commit: str
    variant: str
    signed_by: str


@dataclass(frozen=True)
class LocalHub:
    url: str
    root: Path
    registry: Path | None = None
    builds: tuple[HubBuild, ...] = ()
    not_published: tuple[tuple[str, str], ...] = ()
    """(op, why): kernels that cannot be built as hub builds; the demo runs them in-tree."""


@contextmanager
def _environment(values: dict[str, str | None]) -> Iterator[None]:
    previous = {name: os.environ.get(name) for name in values}
    try:
        for name, value in values.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        yield
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def missing_extra() -> str | None:
    """Why the round trip cannot run here (the ``hub`` extra is not installed), or None."""
    import importlib.util

    absent = [m for m in ("huggingface_hub", "cryptography") if not importlib.util.find_spec(m)]
    if absent:
        return f"needs {', '.join(absent)}: pip install 'kernel-hub[hub]'"
    return None


@contextmanager
def local_hub() -> Iterator[LocalHub]:
    """A ``kernel-hub serve`` store on 127.0.0.1 and a fresh Hugging Face cache, both in a
    temporary directory, with the environment pointing at them for the block."""
    from kernel_hub.hub.server import serve

    with tempfile.TemporaryDirectory(prefix="kernel-hub-demo-") as tmp:
        root = Path(tmp)
        (root / "store").mkdir()
        token = secrets.token_urlsafe(24)
        server = serve(root / "store", write_token=token)
        server.start_in_thread()
        env = {
            "HF_ENDPOINT": server.url,
            "HF_HUB_CACHE": str(root / "hf-cache"),
            "HF_HUB_OFFLINE": "0",
            "HF_TOKEN": token,  # the local store's write token, for publishing
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # the demo prints its own progress
            "KERNEL_HUB_TRUSTED_PUBLISHERS": ORG,
        }
        try:
            with _environment(env):
                yield LocalHub(server.url, root)
        finally:
            server.shutdown()
            server.server_close()


def _hub_registry(root: Path, public_key: str) -> Path:
    """The built-in registry with every op's repo under ``ORG`` and the demo key pinned."""
    import yaml

    from kernel_hub.paths import registry_path

    data = yaml.safe_load(registry_path().read_text())
    for name, op in data["ops"].items():
        op["repo"] = f"{ORG}/{name}"
    data["publishers"] = {ORG: {"keys": [public_key]}}
    path = root / "registry.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def publish_and_fetch(hub: LocalHub, progress: Callable[[str], None]) -> LocalHub:
    """Key, publish every in-tree kernel, pin the key, fetch + verify + load each op by range."""
    from kernel_hub.hub.publish import publish_kernel
    from kernel_hub.hub.signing import generate_key_pair
    from kernel_hub.loading.resolver import get_kernel, in_tree_dir
    from kernel_hub.registry.registry import load_registry

    key = generate_key_pair(hub.root / "publisher-key")
    progress(f"hub: ephemeral publisher key {key.key_id}, store served at {hub.url}")
    entries = list(load_registry())
    not_published = []
    for index, entry in enumerate(entries, 1):
        progress(f"hub: [{index}/{len(entries)}] build, sign and publish {ORG}/{entry.name}")
        try:
            publish_kernel(
                in_tree_dir(entry),
                f"{ORG}/{entry.name}",
                sign_key=key.private_path,
                build_dir=hub.root / "build" / entry.name,
            )
        except KernelHubError as exc:  # say why, run that op in-tree, go on
            not_published.append((entry.name, str(exc)))
    registry = _hub_registry(hub.root, key.public_key)
    skipped = dict(not_published)
    builds = []
    for entry in load_registry(registry):
        if entry.name in skipped:
            continue
        progress(f"hub: fetch, verify and load {entry.repo} {entry.version}")
        module = get_kernel(entry.name, registry=registry, version=str(entry.version), lock=False)
        origin = module.origin
        builds.append(
            HubBuild(
                entry.name,
                origin.repo,
                str(module.manifest.version),
                origin.commit,
                origin.variant,
                key.key_id,
            )
        )
    return LocalHub(hub.url, hub.root, registry, tuple(builds), tuple(not_published))


def hub_rows(
    hub: LocalHub, models: list[str], threads: int | None, progress: Callable[[str], None]
) -> list[dict[str, Any]]:
    """The demo's comparison with every published op taken from its hub build (by the
    registry's version range) and the rest in-tree."""
    from kernel_hub.loading.mappings import kernel_mapping
    from kernel_hub.models.demo import run_demo
    from kernel_hub.registry.registry import load_registry

    registry = load_registry(hub.registry)
    mapping = {b.op: str(registry.get(b.op).version) for b in hub.builds}
    with kernel_mapping(mapping):
        return run_demo(models, registry=hub.registry, threads=threads, progress=progress)
