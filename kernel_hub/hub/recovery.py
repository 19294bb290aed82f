"""Key compromise recovery, publisher side: which listed builds an index may keep once keys are
revoked (docs/trust.md, "Stolen key: the recovery procedure").

Clients refuse every build a revoked key signed, so an index that still listed them would send
range requests to builds nobody can load; and the last index before the revocation may be the
thief's, listing builds of his (all signed by the stolen key). :func:`vet_listed` keeps a listed
version only when every variant of the build at its commit is signed, for that version, by
keys that are pinned and not revoked. It reads only the signatures and ``metadata.json`` files
(size-capped), never the builds.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path

from packaging.version import InvalidVersion, Version

from kernel_hub.errors import IntegrityError, SourceError
from kernel_hub.registry.publisher_keys import PublisherKeys

from .digests import METADATA_FILE
from .fetch import list_build
from .index import Vet
from .json_source import decode
from .network import MissingOnHub
from .signing import signature_path, verify_signature
from .transfer import MAX_METADATA_BYTES, MAX_SIGNATURE_BYTES, fetch_bytes

logger = logging.getLogger(__name__)


def vet_listed(keys_for: Callable[[str], PublisherKeys | None], what: str) -> Vet:
    """A :data:`~kernel_hub.hub.index.Vet` checking each listed build against ``keys_for(repo)``
    (the registry's keys for the repo) plus the revoked keys; what it drops is logged."""

    def vet(
        kernels: Mapping[str, Mapping[str, str]], revoked: Sequence[str]
    ) -> dict[str, dict[str, str]]:
        kept: dict[str, dict[str, str]] = {}
        dropped = []
        for repo, versions in kernels.items():
            keys = keys_for(repo)
            if keys is not None:
                keys = replace(keys, revoked=tuple(dict.fromkeys((*keys.revoked, *revoked))))
            for version, commit in versions.items():
                if keys is not None and _signed(repo, version, commit, keys, what):
                    kept.setdefault(repo, {})[version] = commit
                else:
                    dropped.append(f"{repo} {version} ({commit[:12]})")
        if dropped:
            logger.warning(
                "%s: no longer listed, not signed by a trusted key (republish what is needed as "
                "a new version): %s",
                what,
                ", ".join(dropped),
            )
        return kept

    return vet


def _signed(repo: str, version: str, commit: str, keys: PublisherKeys, what: str) -> bool:
    where = f"{what}: checking {repo} {version}"
    try:
        variants = list_build(repo, commit, where)
        for variant in variants:
            name = signature_path(variant)
            signature = fetch_bytes(repo, commit, name, limit=MAX_SIGNATURE_BYTES, where=where)
            metadata = fetch_bytes(
                repo,
                commit,
                f"build/{variant}/{METADATA_FILE}",
                limit=MAX_METADATA_BYTES,
                where=where,
            )
            verified = verify_signature(
                Path(name),
                metadata,
                repo=repo,
                variant=variant,
                keys=keys,
                text=decode(Path(name), signature),
            )
            if Version(verified.version) != Version(version):
                return False
    except (IntegrityError, SourceError, MissingOnHub, InvalidVersion):
        return False
    return bool(variants)
