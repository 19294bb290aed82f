"""Kernel versions on the hub: git tags ``vX.Y.Z`` plus a moving branch ``vX`` per major version."""

from __future__ import annotations

import re
from collections.abc import Mapping

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from kernel_hub.errors import HubError, KernelHubError

_TAG = re.compile(r"^v(\d+\.\d+\.\d+)$")
_BRANCH = re.compile(r"^v(\d+)$")


def tag_name(version: Version) -> str:
    return f"v{version}"


def branch_name(version: Version) -> str:
    return f"v{version.major}"


def version_of_tag(tag: str) -> Version | None:
    """``Version('1.2.0')`` for tag ``v1.2.0``; None for other refs."""
    match = _TAG.match(tag)
    return Version(match.group(1)) if match else None


def major_of_branch(ref: str) -> int | None:
    """1 for branch ``v1`` (which must hold a 1.x build); None for other refs."""
    match = _BRANCH.match(ref)
    return int(match.group(1)) if match else None


def parse_range(value: str | int) -> SpecifierSet:
    """A version range: ``">=1.2,<2"``, an exact ``"1.2.0"``, or a major version ``1`` (int)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return SpecifierSet(f">={value},<{value + 1}")
    text = str(value).strip()
    try:
        return SpecifierSet(f"=={Version(text)}")
    except InvalidVersion:
        pass
    try:
        spec = SpecifierSet(text)
    except InvalidSpecifier:
        spec = None
    if spec is None or not text:
        raise KernelHubError(
            f"invalid version range {value!r}; expected e.g. '>=1.2,<2', an exact '1.2.0' "
            "or a major version as an int"
        )
    return spec


def select_version(
    versions: Mapping[Version, str], spec: SpecifierSet, *, what: str
) -> tuple[Version, str]:
    """The highest version in ``spec`` and its commit; the error lists the versions that exist."""
    matching = [v for v in versions if spec.contains(v, prereleases=True)]
    if not matching:
        listing = ", ".join(str(v) for v in sorted(versions)) or "(none)"
        raise HubError(f"{what}: no version matches {spec}; versions that exist: {listing}")
    best = max(matching)
    return best, versions[best]
