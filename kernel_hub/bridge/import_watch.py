"""Run a callback once a module has been imported by someone else, without importing it.

kernel-hub must react to some libraries (torchax) as soon as they are loaded, but must never load
them itself: importing torchax changes torch's process-wide device naming.
"""

from __future__ import annotations

import importlib.abc
import sys
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

Callback = Callable[[ModuleType], None]


class _Watcher(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the real loader of a watched module to run callbacks after it."""

    def __init__(self) -> None:
        self.callbacks: dict[str, list[Callback]] = {}

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in self.callbacks:
            return None
        spec = _find_with_others(self, fullname, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_notify(module: ModuleType) -> None:
            exec_module(module)
            for callback in self.callbacks.pop(fullname, []):
                _run(callback, module)

        spec.loader.exec_module = exec_then_notify
        return spec


def _find_with_others(watcher: _Watcher, fullname: str, path: Any, target: Any) -> Any:
    for finder in sys.meta_path:
        if finder is watcher or not hasattr(finder, "find_spec"):
            continue
        spec = finder.find_spec(fullname, path, target)
        if spec is not None:
            return spec
    return None


def _run(callback: Callback, module: ModuleType) -> None:
    # The import the user asked for must not fail because of kernel-hub: say what went wrong.
    try:
        callback(module)
    except Exception as exc:
        warnings.warn(
            f"kernel-hub: reacting to the import of {module.__name__} failed: "
            f"{type(exc).__name__}: {exc}",
            RuntimeWarning,
            stacklevel=2,
        )


_WATCHER = _Watcher()


def when_imported(name: str, callback: Callback) -> None:
    """Call ``callback(module)`` now if ``name`` is imported, else right after its first import."""
    module = sys.modules.get(name)
    if module is not None:
        callback(module)
        return
    if _WATCHER not in sys.meta_path:
        sys.meta_path.insert(0, _WATCHER)
    _WATCHER.callbacks.setdefault(name, []).append(callback)
