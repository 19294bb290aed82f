"""The staging cases (staging_cases.py) run in a fresh pytest process.

Whether the bridge stages inputs depends on process-wide state that the first kernel-hub call
fixes for good (JAX's CPU dispatch mode, set before JAX's backends start, and the exchange), so in
a long test session earlier tests decide it; in a child each case gets the state a user's process
starts with."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

CASES = Path(__file__).with_name("staging_cases.py")


def test_staging_cases_pass_in_a_fresh_process():
    out = subprocess.run(
        [sys.executable, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider", str(CASES)],
        capture_output=True,
        text=True,
        cwd=CASES.parent.parent,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    assert re.search(r"^9 passed", out.stdout, re.MULTILINE), out.stdout[-2000:]
