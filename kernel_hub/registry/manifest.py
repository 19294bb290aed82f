"""A kernel's manifest (``kernel.yaml``): name, version, package, ops, layers, requirements."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from kernel_hub.errors import RequirementError
from kernel_hub.platform import PLATFORMS, Platform
from kernel_hub.version import (
    KERNEL_API_REQUIREMENT,
    KERNEL_API_VERSION,
    UNDECLARED_KERNEL_APIS,
    __version__,
)

from .yaml_source import FieldReader, key_lines, load_yaml

MANIFEST_NAME = "kernel.yaml"
_FIELDS = {
    "name",
    "version",
    "package",
    "summary",
    "license",
    "ops",
    "layers",
    "implementations",
    "requires",
}
_SEMVER = re.compile(r"^\d+\.\d+\.\d+$")


@dataclass(frozen=True)
class Manifest:
    """What a kernel build declares about itself."""

    name: str
    version: Version
    package: str
    """Python package directory beside the manifest."""
    ops: tuple[str, ...]
    layers: tuple[str, ...]
    implementations: Mapping[str, tuple[Platform, ...]]
    """Implementation name -> platforms it runs on."""
    requires: Mapping[str, SpecifierSet]
    summary: str = ""
    license: str = "Apache-2.0"
    path: Path | None = None
    lines: Mapping[str, int] = field(default_factory=dict, compare=False, repr=False)
    """Line of each field in ``path``, and of each implementation (``implementations.<name>``)."""

    def line_for(self, key: str) -> int | None:
        """The line of field ``key`` (see ``lines``), or None."""
        return self.lines.get(key)

    def implementations_on(self, platform: Platform) -> tuple[str, ...]:
        return tuple(name for name, plats in self.implementations.items() if platform in plats)

    def check_requirements(self) -> None:
        """Raise ``RequirementError`` naming every unmet ``requires`` entry.

        ``kernel-hub`` is matched against the kernel API version (``kernel_hub.kernel_api``), not
        the package version, and is required: a build without it predates the kernel API and
        imports kernel-hub modules that may have moved; one whose range admits kernel API 1.0-1.2
        was made before the ``KERNEL`` declaration.
        """
        problems = []
        api_spec = self.requires.get(KERNEL_API_REQUIREMENT)
        if api_spec is None:
            problems.append(
                f'a kernel API version (requires: {{{KERNEL_API_REQUIREMENT}: ">=1.0"}}); it '
                f"declares none, so it was built before kernel_hub.kernel_api existed and imports "
                f"kernel-hub internals. This kernel-hub provides kernel API "
                f"{KERNEL_API_VERSION}: rebuild the kernel against kernel_hub.kernel_api"
            )
        elif any(api_spec.contains(Version(old)) for old in UNDECLARED_KERNEL_APIS):
            problems.append(
                f"kernel API {KERNEL_API_REQUIREMENT}{api_spec}: a build for kernel API 1.0-1.2 "
                f"(module attributes, no KERNEL declaration), which this kernel-hub {__version__} "
                f"no longer loads (it provides kernel API {KERNEL_API_VERSION} and loads builds "
                f'that ask for {KERNEL_API_REQUIREMENT}: ">=1.3" and export KERNEL): rebuild the '
                "kernel against kernel_hub.kernel_api"
            )
        elif not api_spec.contains(Version(KERNEL_API_VERSION), prereleases=True):
            problems.append(
                f"kernel API {KERNEL_API_REQUIREMENT}{api_spec} (this kernel-hub "
                f"{__version__} provides kernel API {KERNEL_API_VERSION})"
            )
        for dist, spec in self.requires.items():
            if dist == KERNEL_API_REQUIREMENT:
                continue
            try:
                installed = metadata.version(dist)
            except metadata.PackageNotFoundError:
                problems.append(f"{dist}{spec} (not installed)")
                continue
            if not spec.contains(Version(installed), prereleases=True):
                problems.append(f"{dist}{spec} (installed: {installed})")
        if problems:
            raise RequirementError(f"kernel {self.name} {self.version} needs {'; '.join(problems)}")


def parse_manifest(path: str | Path, text: str | None = None) -> Manifest:
    path = Path(path)
    fields = FieldReader(path, load_yaml(path, text), "manifest", _FIELDS)
    raw_version = str(fields.get("version", (str, int, float)))
    if not _SEMVER.match(raw_version):
        raise fields.error("version", f"expected a semantic version X.Y.Z, got {raw_version!r}")
    try:
        version = Version(raw_version)
    except InvalidVersion:  # pragma: no cover - the regex above admits only valid versions
        raise fields.error("version", f"invalid version {raw_version!r}") from None
    package = fields.get("package", str)
    if not package.isidentifier():
        raise fields.error("package", f"{package!r} is not a Python identifier")

    impl_node = fields.get("implementations", dict)
    impl_fields = FieldReader(path, impl_node, "manifest implementations", set(impl_node))
    implementations: dict[str, tuple[Platform, ...]] = {}
    for name, platforms in impl_node.items():
        if not isinstance(platforms, list) or not all(p in PLATFORMS for p in platforms):
            raise impl_fields.error(
                name, f"expected a list drawn from {', '.join(PLATFORMS)}, got {platforms!r}"
            )
        implementations[name] = tuple(platforms)

    requires_node = fields.get("requires", dict, {})
    requires: dict[str, SpecifierSet] = {}
    for dist, spec in requires_node.items():
        try:
            requires[dist] = SpecifierSet(str(spec))
        except InvalidSpecifier:
            raise fields.error("requires", f"{dist}: invalid version range {spec!r}") from None

    lines = key_lines(fields.node) | key_lines(impl_node, "implementations.")
    return Manifest(
        name=fields.get("name", str),
        version=version,
        package=package,
        ops=fields.get_str_list("ops"),
        layers=fields.get_str_list("layers", ()),
        implementations=implementations,
        requires=requires,
        summary=fields.get("summary", str, ""),
        license=fields.get("license", str, "Apache-2.0"),
        path=path,
        lines=lines,
    )


def load_manifest(kernel_dir: str | Path) -> Manifest:
    return parse_manifest(Path(kernel_dir) / MANIFEST_NAME)
