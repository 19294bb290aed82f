"""A hostile hub: kernel-hub's own server with a handler that lies (docs/trust.md, threat model).

Each attack checks what the client did, that nothing the attacker sent is left anywhere on disk
(the whole test folder is scanned: the cache, ``HF_HOME``, ``HOME`` and a site-packages-like
folder, everything but the server's own store), and that a good build cached before the attack
still loads offline afterwards.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kernel_hub.errors import KernelHubError
from kernel_hub.loading.resolver import get_kernel

from .hub_helpers import cache_dir

MARK = b"kernel-hub-attacker-was-here"
PAYLOAD = b"import os; os.environ['PWNED'] = '1'  # " + MARK + b"\n"
API_FILE = "build/torch-cpu/rmsnorm/api.py"
METADATA = "build/torch-cpu/metadata.json"


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
