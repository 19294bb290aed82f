"""Every python and bash snippet of README.md and docs/*.md runs, at small sizes, on CPU.

Each runs in its own process (``python -P``: the installed kernel_hub, never the checkout) in an
empty directory, offline; see ``doc_snippets`` for the marks that give a snippet its setup or its
small-size switch. A skipped snippet names the test or script that runs it instead, and that
file must exist.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from doc_snippets import ROOT, SETUPS, SHELL_SETUPS, Snippet, all_snippets

SNIPPETS = all_snippets()
_PATH_IN_REASON = re.compile(r"`?((?:tests|scripts|benchmarks|kernels)/[\w/.-]+)`?")


def _environment(tmp_path: Path, snippet: Snippet) -> dict[str, str]:
    bin_dir = tmp_path / ".bin"
    bin_dir.mkdir()
    # `kernel-hub` and `python` in a bash snippet are this interpreter, as after `pip install`
    for name, command in (("kernel-hub", "-m kernel_hub.cli"), ("python", "")):
        shim = bin_dir / name
        shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -P {command} "$@"\n')
        shim.chmod(0o755)
    env = dict(os.environ)
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{env['PATH']}",
        HF_HUB_OFFLINE="1",
        HF_HOME=str(tmp_path / ".hf"),
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
    code = snippet.runnable_code()
    if snippet.language == "python":
        setup = SETUPS[snippet.setup] if snippet.setup else ""
        script = tmp_path / "snippet.py"
        script.write_text(setup + "\n" + code)
        command = [sys.executable, "-P", str(script)]
    else:
        setup = SHELL_SETUPS[snippet.setup] if snippet.setup else ""
        script = tmp_path / "snippet.sh"
        script.write_text(setup + "\n" + code)
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
    assert done.returncode == 0, f"{snippet.id}:\n{code}\n{output}"


def test_marks_are_known() -> None:
    assert SNIPPETS, "no snippets found"
    for snippet in SNIPPETS:
        setups = SETUPS if snippet.language == "python" else SHELL_SETUPS
        assert snippet.setup is None or snippet.setup in setups, snippet.id
        if not snippet.skip:
            snippet.runnable_code()  # every small-size switch still matches the text
