"""The runnable snippets of README.md and docs/*.md, and what a test needs to run each one.

A fenced ``python`` or ``bash`` block runs exactly as written, in a fresh directory, offline: a
block that needs a model makes a tiny one itself, in the text the reader sees. Comments on the
lines just above a block (visible in the Markdown source, not in the rendered page) set where it
runs, never what it runs:

    <!-- doc-test setup: local-hub -->    a bash block that publishes to a hub runs against a
                                          local ``kernel-hub serve`` (HF_ENDPOINT), as its text says
    <!-- doc-test env: NAME=VALUE -->     an environment variable for the run
    <!-- doc-test skip: REASON -->        not run here; REASON names the hardware it needs or the
                                          test or script that runs it instead

Other languages (yaml, text) are shown, not run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
RUNNABLE = ("python", "bash")
_FENCE = re.compile(r"^```(\S*)")
_MARK = re.compile(r"^<!-- doc-test (setup|env|skip): (.+?) -->$")


@dataclass
class Snippet:
    path: Path
    line: int
    language: str
    code: str
    setup: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    skip: str | None = None

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def _marks(lines: list[str], fence: int) -> list[tuple[str, str]]:
    marks = []
    index = fence - 1
    while index >= 0 and (found := _MARK.match(lines[index].strip())):
        marks.append((found.group(1), found.group(2)))
        index -= 1
    return marks[::-1]


def snippets(path: Path) -> list[Snippet]:
    """Every fenced block of ``path`` in a runnable language, with its doc-test marks."""
    lines = path.read_text().splitlines()
    found: list[Snippet] = []
    index = 0
    while index < len(lines):
        fence = _FENCE.match(lines[index])
        if not fence:
            index += 1
            continue
        end = next(i for i in range(index + 1, len(lines)) if lines[i].startswith("```"))
        language = fence.group(1)
        if language in RUNNABLE:
            snippet = Snippet(path, index + 1, language, "\n".join(lines[index + 1 : end]) + "\n")
            for key, value in _marks(lines, index):
                if key == "setup":
                    snippet.setup = value
                elif key == "env":
                    name, _, env_value = value.partition("=")
                    snippet.env[name] = env_value
                else:
                    snippet.skip = value
            found.append(snippet)
        index = end + 1
    return found


def all_snippets() -> list[Snippet]:
    return [s for path in DOC_FILES for s in snippets(path)]


SHELL_SETUPS: dict[str, str] = {
    # A `kernel-hub serve` store on 127.0.0.1 as the hub, a token for it, and kernels/ as in a
    # checkout. The server stops when the snippet's shell exits.
    "local-hub": """
mkdir -p hub-store kernels
builtin=$(python -c 'from kernel_hub.paths import kernels_dir; print(kernels_dir())')
cp -r "$builtin/rmsnorm" kernels/
export KERNEL_HUB_SERVE_WRITE_TOKEN=local-doc-test-write-token
kernel-hub serve hub-store --port 0 > serve.log 2>&1 &
server=$!
trap 'kill $server' EXIT
until grep -q '^serving' serve.log; do sleep 0.2; kill -0 $server; done
export HF_ENDPOINT=$(sed -n 's/.* at \\(http[^ ]*\\) .*/\\1/p' serve.log)
export HF_TOKEN=$KERNEL_HUB_SERVE_WRITE_TOKEN
export HF_HUB_DISABLE_TELEMETRY=1
""",
}
