"""Every python and bash snippet of README.md and docs/*.md runs exactly as written, on CPU.

Each runs in its own process (``python -P``: the installed kernel_hub, never the checkout) in an
empty directory with the network blocked: Hugging Face offline, and every connection that is not
to this host refused (``sitecustomize`` below). A snippet that needs a model makes a tiny one in
its own text. See ``doc_snippets`` for the marks that say where a snippet runs. A skipped snippet
names the test or script that runs it instead, and that file must exist.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from doc_snippets import ROOT, SHELL_SETUPS, Snippet, all_snippets

SNIPPETS = all_snippets()
_PATH_IN_REASON = re.compile(r"`?((?:tests|scripts|benchmarks|kernels)/[\w/.-]+)`?")

NETWORK_BLOCK = '''
"""Loaded by every Python process of a doc snippet: connections leave this host only by failing."""
import socket

_LOCAL = {"localhost", "127.0.0.1", "::1"}
_getaddrinfo, _connect = socket.getaddrinfo, socket.socket.connect


def _local_only(host, *args, **kwargs):
    if isinstance(host, bytes):
        host = host.decode()
    if host is not None and host not in _LOCAL:
        raise OSError(f"doc test: the network is blocked (a snippet looked up {host!r})")
    return _getaddrinfo(host, *args, **kwargs)


def _connect_local(self, address):
    if self.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in _LOCAL:
        raise OSError(f"doc test: the network is blocked (a snippet connected to {address!r})")
    return _connect(self, address)


socket.getaddrinfo = _local_only
socket.socket.connect = _connect_local
'''


def _environment(tmp_path: Path, snippet: Snippet) -> dict[str, str]:
    bin_dir = tmp_path / ".bin"
    bin_dir.mkdir()
    # `kernel-hub` and `python` in a bash snippet are this interpreter, as after `pip install`
    for name, command in (("kernel-hub", "-m kernel_hub.cli"), ("python", "")):
        shim = bin_dir / name
        shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -P {command} "$@"\n')
        shim.chmod(0o755)
    site_dir = tmp_path / ".site"
    site_dir.mkdir()
    (site_dir / "sitecustomize.py").write_text(NETWORK_BLOCK)
    env = dict(os.environ)
    python_path = [str(site_dir), *filter(None, [env.get("PYTHONPATH")])]
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{env['PATH']}",
        PYTHONPATH=os.pathsep.join(python_path),
        HF_HUB_OFFLINE="1",
        HF_HOME=str(tmp_path / ".hf"),
        KERNEL_HUB_STATE_DIR=str(tmp_path / ".kernel-hub-state"),
        JAX_PLATFORMS="cpu",
        TORCHINDUCTOR_CACHE_DIR=str(tmp_path / ".inductor"),
    )
    env.update(snippet.env)
    return env


@pytest.mark.slow
@pytest.mark.parametrize("snippet", SNIPPETS, ids=[s.id for s in SNIPPETS])
def test_snippet_runs(snippet: Snippet, tmp_path: Path) -> None:
    if snippet.skip:
        paths = _PATH_IN_REASON.findall(snippet.skip)
        assert paths, f"{snippet.id}: a skip must name the test or script that runs it instead"
        for path in paths:
            assert (ROOT / path).exists(), f"{snippet.id}: {path} does not exist"
        pytest.skip(snippet.skip)
    if snippet.language == "python":
        script = tmp_path / "snippet.py"
        script.write_text(snippet.code)
        command = [sys.executable, "-P", str(script)]
    else:
        setup = SHELL_SETUPS[snippet.setup] if snippet.setup else ""
        script = tmp_path / "snippet.sh"
        script.write_text(setup + "\n" + snippet.code)
        command = ["bash", "-euo", "pipefail", str(script)]
    done = subprocess.run(
        command,
        cwd=tmp_path,
        env=_environment(tmp_path, snippet),
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = done.stdout[-4000:] + done.stderr[-4000:]
    assert done.returncode == 0, f"{snippet.id}:\n{snippet.code}\n{output}"


def test_marks_are_known() -> None:
    """Only a bash block may run against the local hub stand-in; a Python block runs alone."""
    assert SNIPPETS, "no snippets found"
    for snippet in SNIPPETS:
        if snippet.setup is not None:
            assert snippet.language == "bash" and snippet.setup in SHELL_SETUPS, snippet.id


def test_the_network_is_blocked(tmp_path: Path) -> None:
    """What the snippets run under: a lookup of a host elsewhere fails, offline mode or not."""
    snippet = Snippet(ROOT / "README.md", 0, "python", "", env={"HF_HUB_OFFLINE": "0"})
    code = "import socket\nsocket.create_connection(('huggingface.co', 443), timeout=5)\n"
    done = subprocess.run(
        [sys.executable, "-P", "-c", code],
        cwd=tmp_path,
        env=_environment(tmp_path, snippet),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "doc test: the network is blocked" in done.stderr
