"""One coverage run per (mode, architecture) in a test session, shared by the tests that read it.

The coverage sweep (test_coverage.py) and the docs/coverage.md check (test_docs_coverage.py)
both need architectures' inference results; a result does not depend on which other
architectures ran beside it (each is built, run and compared on its own), so an architecture
checked once is not built, kernelized and compared again. Both files live here, in one directory,
so that they run in one pytest process (one part of scripts/test.sh) and share the results.
"""

from __future__ import annotations

from collections.abc import Sequence

from kernel_hub.models.coverage import Result, run_coverage

_results: dict[tuple[str, str], Result] = {}


def coverage_results(mode: str, model_types: Sequence[str]) -> list[Result]:
    """``run_coverage(mode, model_types=model_types)``, each architecture run once a session."""
    missing = [t for t in model_types if (mode, t) not in _results]
    if missing:
        for result in run_coverage(mode, model_types=missing):
            _results[mode, result.model_type] = result
    return [_results[mode, t] for t in model_types]
