"""registry.yaml: op names -> kernels, version ranges, layers, and optionally an override of the
kernel's implementation order per platform."""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from packaging.specifiers import InvalidSpecifier, SpecifierSet

from kernel_hub.errors import SourceError, UnknownNameError
from kernel_hub.paths import registry_path
from kernel_hub.platform import PLATFORMS, Platform

from .publisher_keys import PublisherKeys, keys_for, parse_publishers
from .yaml_source import FieldReader, key_lines, line_of, load_yaml

SCHEMA_VERSION = 1
_OP_FIELDS = {
    "summary",
    "aliases",
    "kernel",
    "repo",
    "version",
    "revision",
    "commit",
    "implementations",
    "layers",
}
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


@dataclass(frozen=True)
class OpEntry:
    """One op of the registry."""

    name: str
    kernel: str
    """Directory name under ``kernels/`` holding the in-tree build."""
    version: SpecifierSet
    implementations: Mapping[Platform, tuple[str, ...]]
    """The registry's override of the kernel's implementation order, per platform; empty when the
    registry leaves the order to the kernel (its implementation tables). With an override, a
    platform it does not name runs nothing."""
    summary: str = ""
    aliases: tuple[str, ...] = ()
    repo: str | None = None
    """Hugging Face Hub repo with versioned builds, ``org/name``."""
    revision: str | None = None
    """Hub builds: a branch or tag to fetch instead of the highest version in ``version``."""
    commit: str | None = None
    """Hub builds: a pinned commit id (40 hex) to fetch instead of ``version``."""
    layers: tuple[str, ...] = ()
    source: str = ""
    line: int | None = None
    lines: Mapping[str, int] = field(default_factory=dict, compare=False, repr=False)
    """Line of each field: ``layers``, ``implementations``, ``implementations.<platform>``."""

    def line_for(self, key: str) -> int | None:
        """The line of field ``key`` (see ``lines``), else the op's own line."""
        return self.lines.get(key, self.line)

    @property
    def overrides_order(self) -> bool:
        """Whether the registry states the implementation order (else the kernel's applies)."""
        return bool(self.implementations)

    def implementations_for(self, platform: Platform) -> tuple[str, ...]:
        """The override's order on ``platform`` (empty without an override, see
        ``overrides_order``)."""
        return self.implementations.get(platform, ())


@dataclass(frozen=True)
class Registry:
    """All ops, looked up by name or alias."""

    path: Path
    ops: Mapping[str, OpEntry]
    _aliases: Mapping[str, str] = field(default_factory=dict, repr=False)
    publishers: Mapping[str, PublisherKeys] = field(default_factory=dict)
    """Publisher (org or ``org/name``) -> the keys its hub builds must be signed with."""

    def __iter__(self) -> Iterator[OpEntry]:
        return iter(self.ops.values())

    def __contains__(self, name: object) -> bool:
        return name in self.ops or name in self._aliases

    def get(self, name: str) -> OpEntry:
        """Entry for an op name or alias; unknown names suggest the close ones."""
        canonical = self._aliases.get(name, name)
        if canonical not in self.ops:
            raise UnknownNameError("op", name, [*self.ops, *self._aliases])
        return self.ops[canonical]

    def layer_owner(self, layer_name: str) -> OpEntry:
        """The op whose kernel provides a layer name such as ``RMSNorm``."""
        for entry in self.ops.values():
            if layer_name in entry.layers:
                return entry
        raise UnknownNameError("layer", layer_name, [n for e in self for n in e.layers])

    def keys_for(self, repo: str) -> PublisherKeys | None:
        """The signing keys pinned for a hub repo (its own entry, else its organisation's)."""
        return keys_for(self.publishers, repo)


def _parse_op(path: Path, name: str, node: object, line: int | None) -> OpEntry:
    fields = FieldReader(path, node, f"op {name!r}", _OP_FIELDS, line)
    raw_version = fields.get("version", str)
    try:
        version = SpecifierSet(raw_version)
    except InvalidSpecifier:
        raise fields.error(
            "version", f"invalid version range {raw_version!r} (expected e.g. '>=1.0,<2')"
        ) from None
    impl_node = fields.get("implementations", dict, {})
    impl_fields = FieldReader(
        path,
        impl_node,
        f"op {name!r} implementations",
        set(PLATFORMS),
        line_of(node, "implementations"),
    )
    implementations = {
        platform: impl_fields.get_str_list(platform)
        for platform in PLATFORMS
        if platform in impl_node
    }
    if "implementations" in fields.node and not implementations:
        raise fields.error(
            "implementations", f"name at least one platform of {', '.join(PLATFORMS)}"
        )
    repo = fields.get("repo", str, None)
    if repo is not None and repo.count("/") != 1:
        raise fields.error("repo", f"expected 'org/name', got {repo!r}")
    revision = fields.get("revision", str, None)
    commit = fields.get("commit", str, None)
    for key, value in (("revision", revision), ("commit", commit)):
        if value is not None and repo is None:
            raise fields.error(key, f"{key!r} selects a hub build, so the op needs a 'repo' too")
    if revision is not None and commit is not None:
        raise fields.error("commit", "give 'revision' (a branch or tag) or 'commit', not both")
    if revision is not None and not revision.strip():
        raise fields.error("revision", "expected a branch or tag name, got an empty string")
    if commit is not None and not _COMMIT.match(commit):
        raise fields.error("commit", f"expected a full 40-hex commit id, got {commit!r}")
    lines = key_lines(fields.node) | key_lines(impl_node, "implementations.")
    return OpEntry(
        name=name,
        kernel=fields.get("kernel", str),
        version=version,
        implementations=implementations,
        summary=fields.get("summary", str, ""),
        aliases=fields.get_str_list("aliases", ()),
        repo=repo,
        revision=revision,
        commit=commit,
        layers=fields.get_str_list("layers", ()),
        source=str(path),
        line=line,
        lines=lines,
    )


def parse_registry(path: str | Path, text: str | None = None) -> Registry:
    """Parse and validate a registry file."""
    path = Path(path)
    root = FieldReader(path, load_yaml(path, text), "registry", {"schema", "ops", "publishers"})
    schema = root.get("schema", int)
    if schema != SCHEMA_VERSION:
        raise root.error(
            "schema", f"unsupported schema {schema}; this kernel-hub reads {SCHEMA_VERSION}"
        )
    ops_node = root.get("ops", dict)
    ops: dict[str, OpEntry] = {}
    aliases: dict[str, str] = {}
    for name, node in ops_node.items():
        line = ops_node.lines.get(name)
        entry = _parse_op(path, name, node, line)
        for alias in entry.aliases:
            if alias in ops_node or alias in aliases:
                taken_by = alias if alias in ops_node else aliases[alias]
                raise SourceError(
                    path, line, f"op {name!r}: alias {alias!r} is already op {taken_by!r}"
                )
            aliases[alias] = name
        ops[name] = entry
    publishers = (
        parse_publishers(path, root.node["publishers"], line_of(root.node, "publishers"))
        if "publishers" in root.node
        else {}
    )
    return Registry(path=path, ops=ops, _aliases=aliases, publishers=publishers)


@functools.cache
def _load_cached(path: Path, mtime_ns: int) -> Registry:
    return parse_registry(path)


def load_registry(path: str | Path | None = None) -> Registry:
    """The registry at ``path`` (default: ``$KERNEL_HUB_REGISTRY`` or the in-tree file)."""
    path = Path(path) if path is not None else registry_path()
    try:
        mtime = path.stat().st_mtime_ns
    except FileNotFoundError:
        raise SourceError(path, None, "registry file not found") from None
    return _load_cached(path.resolve(), mtime)
