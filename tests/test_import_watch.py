"""Callbacks on another module's import, without importing it."""

from __future__ import annotations

import sys

import pytest

from kernel_hub.bridge.import_watch import when_imported


@pytest.fixture
def fresh_module(tmp_path, monkeypatch):
    """A module name nobody has imported yet, importable from tmp_path."""
    name = f"watched_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text("VALUE = 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_callback_runs_after_the_module_executes_and_not_before(fresh_module):
    seen = []
    when_imported(fresh_module, lambda module: seen.append(module.VALUE))
    assert seen == [] and fresh_module not in sys.modules
    __import__(fresh_module)
    assert seen == [42]
    sys.modules.pop(fresh_module)
    __import__(fresh_module)
    assert seen == [42], "a callback runs once"


def test_callback_runs_at_once_for_an_imported_module(fresh_module):
    module = __import__(fresh_module)
    seen = []
    when_imported(fresh_module, seen.append)
    assert seen == [module]


def test_a_failing_callback_warns_and_the_import_still_succeeds(fresh_module):
    def broken(module):
        raise ValueError("boom")

    when_imported(fresh_module, broken)
    with pytest.warns(RuntimeWarning, match=rf"import of {fresh_module} failed: ValueError: boom"):
        module = __import__(fresh_module)
    assert module.VALUE == 42
