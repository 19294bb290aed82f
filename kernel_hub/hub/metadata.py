"""``metadata.json`` of a build variant: readable by Hugging Face ``kernels`` and by kernel-hub.

``kernels`` requires ``id``, ``name``, ``version`` (an integer: the major version), ``license``,
``python-depends`` (from its allowlist, which has no jax, so it stays empty) and ``backend``; it
accepts a ``digest`` in the format of :mod:`kernel_hub.hub.digests` and ignores other keys.
kernel-hub's own fields live under ``"kernel-hub"``: the semantic version, variant, framework,
requirements (``jax>=``, ``torch>=``...), ops, layers, the implementations that run there, and
each file's size in bytes (``sizes``: signed with the rest, so a download stops at the signed
size; builds made before sizes were recorded fall back to fixed caps, see :mod:`.transfer`).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from kernel_hub.errors import SourceError
from kernel_hub.registry.manifest import Manifest

from .digests import ALGORITHM, METADATA_FILE
from .json_source import field_line, load_json
from .variants import Variant

KERNEL_NAME = re.compile(r"^[a-z][-a-z0-9]*[a-z0-9]$")
"""Kernel names ``kernels`` accepts."""


@dataclass(frozen=True)
class BuildMetadata:
    """What kernel-hub reads back from a variant's ``metadata.json``."""

    name: str
    version: Version
    variant: str
    framework: str
    backend: str
    package: str
    requires: Mapping[str, SpecifierSet]
    ops: tuple[str, ...]
    layers: tuple[str, ...]
    digest: Mapping[str, str]
    """Relative path -> base64 sha256, for every file but metadata.json."""
    sizes: Mapping[str, int] | None = None
    """Relative path -> size in bytes, for the same files (None in builds made before sizes)."""


def make_metadata(
    manifest: Manifest,
    variant: Variant,
    requires: Mapping[str, str],
    digest: Mapping[str, str],
    sizes: Mapping[str, int],
) -> dict[str, Any]:
    """The metadata.json content for one variant of a build."""
    version = manifest.version
    content = hashlib.sha256(json.dumps(sorted(digest.items())).encode()).hexdigest()[:8]
    module_id = re.sub(r"\W", "_", f"{manifest.package}_{version}_{variant.name}_{content}")
    return {
        "id": module_id,
        "name": manifest.name,
        "version": version.major,
        "license": manifest.license,
        "python-depends": [],
        "backend": {"type": variant.backend},
        "digest": {"algorithm": ALGORITHM, "files": dict(sorted(digest.items()))},
        "kernel-hub": {
            "version": str(version),
            "variant": variant.name,
            "framework": variant.framework,
            "package": manifest.package,
            "requires": dict(requires),
            "ops": list(manifest.ops),
            "layers": list(manifest.layers),
            "implementations": list(manifest.implementations_on(variant.platforms[0])),
            "sizes": dict(sorted(sizes.items())),
        },
    }


_OWN_FIELDS = {"version", "variant", "framework", "package", "requires", "ops", "layers", "sizes"}
"""Fields read from the ``"kernel-hub"`` section (error lines are searched for there)."""


def read_metadata(path: str | Path, text: str | None = None) -> BuildMetadata:
    """Parse and check a variant's metadata.json (``path`` is the file or its folder).

    Malformed content raises ``SourceError`` naming the file, the line and the field.
    """
    path = Path(path)
    if path.is_dir():
        path = path / METADATA_FILE
    text, data = load_json(path, text, missing="metadata file not found")

    def fail(field: str | None, message: str) -> SourceError:
        own_field = field in _OWN_FIELDS
        line = field_line(text, field, after="kernel-hub" if own_field else None) if field else 1
        return SourceError(path, line, f"field {field!r}: {message}" if field else message)

    own = data.get("kernel-hub") if isinstance(data, dict) else None
    if not isinstance(own, dict):
        raise fail(None, "no 'kernel-hub' section: this is not a kernel-hub build")
    digest = data.get("digest")
    if not isinstance(digest, dict) or digest.get("algorithm") != ALGORITHM:
        raise fail("digest", f"missing, or its algorithm is not {ALGORITHM!r}")
    files = digest.get("files")
    if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
        raise fail("files", "must map file names to base64 sha256 strings")
    backend = data.get("backend")
    if not isinstance(backend, dict) or not isinstance(backend.get("type"), str):
        raise fail("backend", 'expected {"type": NAME}')
    strings = {}
    for field, node in (("name", data), *((f, own) for f in ("variant", "framework", "package"))):
        if not isinstance(node.get(field), str):
            raise fail(field, f"expected a string, got {node.get(field)!r}")
        strings[field] = node[field]
    lists = {}
    for field in ("ops", "layers"):
        value = own.get(field, [])
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise fail(field, f"expected a list of strings, got {value!r}")
        lists[field] = tuple(value)
    raw_requires = own.get("requires", {})
    if not isinstance(raw_requires, dict) or not all(
        isinstance(v, str) for v in raw_requires.values()
    ):
        raise fail("requires", f"expected distribution -> version range, got {raw_requires!r}")
    try:
        version = Version(own.get("version")) if isinstance(own.get("version"), str) else None
    except InvalidVersion:
        version = None
    if version is None:
        raise fail("version", f"expected a version string, got {own.get('version')!r}")
    try:
        requires = {dist: SpecifierSet(spec) for dist, spec in raw_requires.items()}
    except InvalidSpecifier as exc:
        raise fail("requires", f"bad requirement: {exc}") from None
    sizes = own.get("sizes")
    if sizes is not None and (
        not isinstance(sizes, dict)
        or set(sizes) != set(files)
        or not all(type(n) is int and n >= 0 for n in sizes.values())
    ):
        raise fail("sizes", "expected every digested file's size in bytes, and no other file")
    return BuildMetadata(
        sizes=sizes,
        version=version,
        backend=backend["type"],
        requires=requires,
        digest=dict(files),
        **strings,
        **lists,
    )
