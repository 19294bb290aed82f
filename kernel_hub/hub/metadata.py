"""``metadata.json`` of a build variant: readable by Hugging Face ``kernels`` and by kernel-hub.

``kernels`` requires ``id``, ``name``, ``version`` (an integer: the major version), ``license``,
``python-depends`` (from its allowlist, which has no jax, so it stays empty) and ``backend``; it
accepts a ``digest`` in the format of :mod:`kernel_hub.hub.digests` and ignores other keys.
kernel-hub's own fields live under ``"kernel-hub"``: the semantic version, variant, framework,
requirements (``jax>=``, ``torch>=``...), ops, layers and the implementations that run there.
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


def make_metadata(
    manifest: Manifest, variant: Variant, requires: Mapping[str, str], digest: Mapping[str, str]
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
        },
    }


def read_metadata(path: str | Path) -> BuildMetadata:
    """Parse and check a variant's metadata.json (``path`` is the file or its folder)."""
    path = Path(path)
    if path.is_dir():
        path = path / METADATA_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SourceError(path, None, "metadata file not found") from None
    except json.JSONDecodeError as exc:
        raise SourceError(path, exc.lineno, f"invalid JSON: {exc.msg}") from None

    def fail(message: str) -> SourceError:
        return SourceError(path, None, message)

    own = data.get("kernel-hub") if isinstance(data, dict) else None
    if not isinstance(own, dict):
        raise fail("no 'kernel-hub' section: this is not a kernel-hub build")
    digest = data.get("digest")
    if not isinstance(digest, dict) or digest.get("algorithm") != ALGORITHM:
        raise fail(f"missing digest, or its algorithm is not {ALGORITHM!r}")
    files = digest.get("files")
    if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
        raise fail("digest 'files' must map file names to base64 sha256 strings")
    try:
        version = Version(str(own.get("version")))
        requires = {
            dist: SpecifierSet(spec) for dist, spec in dict(own.get("requires", {})).items()
        }
    except (InvalidVersion, InvalidSpecifier, TypeError, ValueError) as exc:
        raise fail(f"bad version or requirement: {exc}") from None
    try:
        return BuildMetadata(
            name=str(data["name"]),
            version=version,
            variant=str(own["variant"]),
            framework=str(own["framework"]),
            backend=str(data["backend"]["type"]),
            package=str(own["package"]),
            requires=requires,
            ops=tuple(own.get("ops", ())),
            layers=tuple(own.get("layers", ())),
            digest=dict(files),
        )
    except (KeyError, TypeError) as exc:
        raise fail(f"missing field {exc}") from None
