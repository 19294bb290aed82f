"""Exception types. Every message says what was wrong and what would be valid."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from pathlib import Path


class KernelHubError(Exception):
    """Base class for every error kernel-hub raises on purpose."""


class SourceError(KernelHubError, ValueError):
    """A malformed registry, manifest or lock file; names the file and line."""

    def __init__(self, path: str | Path, line: int | None, message: str):
        self.path = str(path)
        self.line = line
        self.detail = message
        where = f"{self.path}:{line}" if line is not None else self.path
        super().__init__(f"{where}: {message}")


def _plural(kind: str) -> str:
    """'families' for 'family', 'implementations of rmsnorm' for 'implementation of rmsnorm'."""
    noun, of, rest = kind.partition(" of ")
    noun = noun[:-1] + "ies" if noun.endswith("y") and noun[-2:-1] not in "aeiou" else noun + "s"
    return noun + of + rest


class UnknownNameError(KernelHubError, KeyError):
    """A name (op, layer, implementation, ...) that is not known; suggests close ones."""

    def __init__(self, kind: str, name: str, valid: Iterable[str]):
        self.kind = kind
        self.name = name
        self.valid = sorted(set(valid))
        close = difflib.get_close_matches(name, self.valid, n=3, cutoff=0.5)
        hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        listing = ", ".join(self.valid) if self.valid else "(none)"
        self.message = f"unknown {kind} {name!r}.{hint} Valid {_plural(kind)}: {listing}."
        super().__init__(self.message)

    def __str__(self) -> str:  # KeyError would otherwise repr() the message
        return self.message


class UnsupportedDeviceError(KernelHubError, RuntimeError):
    """A tensor lives on a device that no kernel-hub runtime path can serve."""


class KernelInputError(KernelHubError, ValueError):
    """Wrong shapes, dtypes or arguments for a kernel op."""


class NoImplementationError(KernelHubError, RuntimeError):
    """No implementation of an op can take these inputs on this platform; lists the reasons."""


class RequirementError(KernelHubError, RuntimeError):
    """A kernel needs a library version this environment does not have."""


class HubError(KernelHubError, RuntimeError):
    """Talking to the Hugging Face Hub (or reading its cache) failed; names op, repo, version."""


class IntegrityError(KernelHubError, RuntimeError):
    """Files of a kernel build differ from their recorded digest or lock file; names the files."""


class UntrustedSourceError(KernelHubError, PermissionError):
    """Downloaded code from a publisher that is not on the allowlist."""
