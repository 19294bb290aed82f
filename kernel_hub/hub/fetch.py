"""Resolve a kernel request to a commit, download the variant that fits this machine, verify it.

Online: list the repo's refs, pick the commit, list ``build/`` at that commit (refusing names that
escape it), then ``snapshot_download`` only ``build/<variant>/`` and its signature into the
Hugging Face cache. Offline (``HF_HUB_OFFLINE=1``): the same resolution from the refs and snapshots
in the cache, with no network call. Either way, on every load and before anyone imports a file,
the signature must verify against a key the registry pins for the publisher and every file must
match the signed digests in ``metadata.json`` (and the lock file, if one pins the op); a build that
fails is removed from the cache. See docs/trust.md.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from kernel_hub.errors import HubError, IntegrityError, SourceError, UntrustedSourceError
from kernel_hub.platform import Platform
from kernel_hub.registry.publisher_keys import PublisherKeys
from kernel_hub.registry.registry import OpEntry

from . import cache, settings
from .client import REPO_TYPE, hub_api, hub_errors, list_refs
from .digests import BYTECODE_DIR, check_relative_name, check_tree_shape, verify_tree
from .lockfile import COMMIT, LockedOp
from .metadata import BuildMetadata, read_metadata
from .signing import signature_path, verify_signature
from .trust import TrustRemoteCode, check_trusted
from .variants import Variant, select_variant
from .versions import parse_range, select_version, tag_name

if TYPE_CHECKING:
    from huggingface_hub import HfApi

BYTECODE_PATTERNS = ["*.pyc", f"**/{BYTECODE_DIR}/**"]


@dataclass(frozen=True)
class HubRequest:
    """Which build of ``repo``: a version range, or a revision (branch, tag or commit id)."""

    repo: str
    spec: SpecifierSet | None = None
    revision: str | None = None

    def __post_init__(self) -> None:
        if (self.spec is None) == (self.revision is None):
            raise ValueError("HubRequest needs exactly one of spec and revision")

    def describe(self) -> str:
        return f"version {self.spec}" if self.spec is not None else f"revision {self.revision}"

    @classmethod
    def for_op(
        cls, entry: OpEntry, version: str | int | None = None, revision: str | None = None
    ) -> HubRequest:
        """What to fetch for a registry entry; ``version``/``revision`` override the registry."""
        if entry.repo is None:
            where = f"{entry.source}:{entry.line}" if entry.line else entry.source
            raise HubError(
                f"op {entry.name} has no hub repo ({where} has no 'repo: org/name'); "
                "it can only be loaded in-tree (source='local')"
            )
        if version is not None and revision is not None:
            raise HubError("pass either version= or revision=, not both")
        if version is not None:
            return cls(entry.repo, spec=parse_range(version))
        if revision is not None:
            return cls(entry.repo, revision=revision)
        if entry.commit is not None or entry.revision is not None:
            return cls(entry.repo, revision=entry.commit or entry.revision)
        return cls(entry.repo, spec=entry.version)


@dataclass(frozen=True)
class Resolved:
    commit: str
    ref: str
    """What to download by: the tag or branch name (so the cache records it), or the commit."""
    version: Version | None
    """The version its tag names, when resolved through a version tag."""


@dataclass(frozen=True)
class HubBuild:
    """A verified build variant in the Hugging Face cache."""

    repo: str
    commit: str
    variant: str
    path: Path
    metadata: BuildMetadata
    signed_by: str
    """Id of the pinned key whose signature verified."""

    @property
    def version(self) -> Version:
        return self.metadata.version


def fetch_build(
    request: HubRequest,
    *,
    what: str,
    platform: Platform | None = None,
    variant: str | None = None,
    trust_remote_code: TrustRemoteCode = False,
    locked: LockedOp | None = None,
    keys: PublisherKeys | None,
) -> HubBuild:
    """Resolve, download (unless offline) and verify one variant; ``what`` starts error messages.

    ``keys`` are the registry's pinned keys for the repo's publisher: the build must be signed by
    one of them. Both checks (publisher, pinned keys) run before anything is downloaded.
    """
    check_trusted(request.repo, trust_remote_code)
    keys = require_keys(request.repo, keys, what)
    if locked is not None:
        request = HubRequest(request.repo, revision=locked.commit)
    if platform is None:
        from kernel_hub.platform import host_platform

        platform = host_platform()
    requested_variant = variant or settings.variant_override()
    api = None
    if settings.offline():
        resolved = resolve_offline(request, what)
        chosen = _select(
            cache.cached_variants(request.repo, resolved.commit), platform, requested_variant, what
        )
    else:
        api = hub_api()
        resolved = resolve_online(api, request, what)
        listing = list_build(api, request.repo, resolved.commit, what)
        chosen = _select(listing, platform, requested_variant, what)
    path = cache.snapshot_dir(request.repo, resolved.commit) / "build" / chosen.name
    # One process or thread at a time downloads, verifies or discards this variant.
    with cache.variant_lock(request.repo, resolved.commit, chosen.name):
        if api is not None:
            download(api, request.repo, resolved, [chosen.name], what)
        metadata, signed_by = verify_or_discard(
            request.repo, resolved, chosen.name, locked, keys, what=what
        )
    return HubBuild(request.repo, resolved.commit, chosen.name, path, metadata, signed_by)


def fetch_all_variants(
    api: HfApi,
    repo: str,
    resolved: Resolved,
    keys: PublisherKeys,
    what: str,
    locked: LockedOp | None = None,
) -> dict[str, BuildMetadata]:
    """Download and verify every variant of a resolved commit (for locks and mirrors)."""
    variants = sorted(list_build(api, repo, resolved.commit, what))
    if not variants:
        raise HubError(f"{what}: {repo} at {resolved.commit[:12]} has no build/<variant>/ folders")
    with contextlib.ExitStack() as held:
        for variant in variants:  # always in the same order: no two fetchers wait on each other
            held.enter_context(cache.variant_lock(repo, resolved.commit, variant))
        download(api, repo, resolved, variants, what)
        return {
            variant: verify_or_discard(repo, resolved, variant, locked, keys, what=what)[0]
            for variant in variants
        }


def require_keys(repo: str, keys: PublisherKeys | None, what: str) -> PublisherKeys:
    """The pinned keys, or a refusal saying how to pin some (nothing unsigned is imported)."""
    if keys is None or not keys.keys:
        org = repo.split("/", 1)[0]
        raise UntrustedSourceError(
            f"{what}: the registry pins no signing key for {repo}'s publisher {org!r}, so no "
            f"build of it can be verified; add 'publishers: {{{org}: {{keys: [ed25519:...]}}}}' "
            "to the registry with the publisher's public key (see 'kernel-hub keygen')"
        )
    return keys


def verify_or_discard(
    repo: str,
    resolved: Resolved,
    variant: str,
    locked: LockedOp | None,
    keys: PublisherKeys,
    *,
    what: str,
) -> tuple[BuildMetadata, str]:
    """``verify_variant`` on the cached variant; on failure nothing of it stays in the cache."""
    path = cache.snapshot_dir(repo, resolved.commit) / "build" / variant
    try:
        return verify_variant(path, variant, resolved.version, locked, repo=repo, keys=keys)
    except (IntegrityError, SourceError, OSError) as exc:  # OSError: a file vanished or unreadable
        cache.discard_variant(repo, resolved.commit, variant)
        raise IntegrityError(
            f"{what}: refusing {repo} build/{variant} at commit "
            f"{resolved.commit[:12]}: {exc}. Nothing of it was kept in the cache."
        ) from None


def _select(available, platform: Platform, requested: str | None, what: str) -> Variant:
    try:
        return select_variant(available, platform, requested)
    except HubError as exc:
        raise HubError(f"{what}: {exc}") from None


def resolve_online(api: HfApi, request: HubRequest, what: str) -> Resolved:
    versions, branches, tags = list_refs(api, request.repo)
    if request.spec is not None:
        version, commit = select_version(versions, request.spec, what=f"{what} ({request.repo})")
        return Resolved(commit, tag_name(version), version)
    revision = request.revision
    if COMMIT.match(revision):
        return Resolved(revision, revision, None)
    for refs in (tags, branches):
        if revision in refs:
            return Resolved(refs[revision], revision, _tag_version(revision, versions, refs))
    raise HubError(
        f"{what}: {request.repo} has no branch or tag {revision!r}; branches: "
        f"{', '.join(sorted(branches)) or '(none)'}; tags: {', '.join(sorted(tags)) or '(none)'}"
    )


def _tag_version(ref: str, versions: dict[Version, str], refs: dict[str, str]) -> Version | None:
    return next(
        (v for v, commit in versions.items() if tag_name(v) == ref and refs[ref] == commit), None
    )


def resolve_offline(request: HubRequest, what: str) -> Resolved:
    repo = request.repo
    offline_hint = f"HF_HUB_OFFLINE is set, so only the cache at {settings.cache_dir()} is searched"
    if request.spec is not None:
        versions = cache.cached_versions(repo)
        matching = {v: c for v, c in versions.items() if request.spec.contains(v, prereleases=True)}
        if not matching:
            cached = ", ".join(str(v) for v in sorted(versions)) or "none"
            raise HubError(
                f"{what}: no cached build of {repo} matches version {request.spec} "
                f"(cached versions: {cached}); {offline_hint}. "
                "Fetch it once online or unset HF_HUB_OFFLINE"
            )
        best = max(matching)
        return Resolved(matching[best], tag_name(best), best)
    revision = request.revision
    commit = revision if COMMIT.match(revision) else cache.cached_refs(repo).get(revision)
    if commit is None or not cache.cached_variants(repo, commit):
        raise HubError(
            f"{what}: {repo} revision {revision} is not in the cache; {offline_hint}. "
            "Fetch it once online or unset HF_HUB_OFFLINE"
        )
    return Resolved(commit, revision, None)


def list_build(api: HfApi, repo: str, commit: str, what: str) -> list[str]:
    """The variants under ``build/`` at ``commit``; any file name escaping ``build/`` is refused."""
    with hub_errors(f"{what}: listing build/ of {repo} at {commit[:12]}"):
        entries = list(
            api.list_repo_tree(repo, "build", recursive=True, revision=commit, repo_type=REPO_TYPE)
        )
    variants = set()
    for entry in entries:
        parts = check_relative_name(entry.path, f"{repo} build/").split("/")
        if parts[0] != "build" or len(parts) < 2:
            raise IntegrityError(f"{what}: refusing file name {entry.path!r}: it escapes build/")
        if len(parts) > 2:  # inside a variant folder (a loose file in build/ is no variant)
            variants.add(parts[1])
    return sorted(variants)


def download(api: HfApi, repo: str, resolved: Resolved, variants: list[str], what: str) -> Path:
    """``snapshot_download`` of ``build/<variant>/`` only; on failure nothing of it stays cached."""
    try:
        with hub_errors(f"{what}: downloading {repo} {resolved.ref}"):
            path = Path(
                api.snapshot_download(
                    repo,
                    repo_type=REPO_TYPE,
                    revision=resolved.ref,
                    cache_dir=settings.cache_dir(),
                    allow_patterns=[
                        pattern for v in variants for pattern in (f"build/{v}/*", signature_path(v))
                    ],
                    ignore_patterns=BYTECODE_PATTERNS,
                )
            )
    except BaseException:
        for variant in variants:
            cache.discard_variant(repo, resolved.commit, variant)
        raise
    if path.name != resolved.commit:
        raise HubError(
            f"{what}: {repo} {resolved.ref} moved from {resolved.commit} to {path.name} "
            "while fetching"
        )
    return path


def verify_variant(
    path: Path,
    variant: str,
    tag_version: Version | None,
    locked: LockedOp | None,
    *,
    repo: str,
    keys: PublisherKeys,
) -> tuple[BuildMetadata, str]:
    """Check a variant folder before any of it is imported: only plain files (or the cache's own
    links to its blobs), the lock entry (if any), the signature over metadata.json by a pinned
    key, then every file against the signed digest. Returns the metadata and the key's id."""
    label = f"build/{variant}"
    if not path.is_dir():
        raise IntegrityError(f"{label} is not in the cache")
    check_tree_shape(path, label=label, links_into=cache.repo_cache_dir(repo) / "blobs")
    if locked is not None:
        files = locked.variants.get(variant)
        if files is None:
            raise IntegrityError(
                f"the lock has no digests for variant {variant} "
                f"(it has {', '.join(locked.variants)}); re-run 'kernel-hub lock'"
            )
        verify_tree(path, files, label=label)
    metadata = read_metadata(path)
    signed_by = verify_signature(
        path.parent.parent, repo=repo, version=str(metadata.version), variant=variant, keys=keys
    )
    verify_tree(path, metadata.digest, label=label)
    if metadata.variant != variant:
        raise IntegrityError(f"{label}/metadata.json describes variant {metadata.variant!r}")
    if tag_version is not None and metadata.version != tag_version:
        raise IntegrityError(
            f"tag {tag_name(tag_version)} holds a build of version {metadata.version}"
        )
    if locked is not None and metadata.version != locked.version:
        raise IntegrityError(
            f"the lock pins version {locked.version} but the build is {metadata.version}"
        )
    return metadata, signed_by
