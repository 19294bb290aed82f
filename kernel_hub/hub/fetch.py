"""Resolve a kernel request to a commit, download the variant that fits this machine, verify it.

Online: list the repo's refs (every commit id checked to be 40 hex), pick the commit, list
``build/`` at that commit (refusing names that escape it or hold control characters), then
download by commit id into a private staging folder: the signature, metadata.json (both under
fixed size caps), the signature checked over those bytes before they are parsed, then exactly the
files the signed digest names, each stopped at its signed size and checked while written. Only a
variant that verified whole is moved into the cache, and only then is the ref recorded. Offline
(``HF_HUB_OFFLINE=1``): the same resolution from the refs and snapshots in the cache. On every
load, before anyone imports a file, the cached variant is verified again: a key the registry pins
for the publisher, every file against the signed digests, the signed version against what was
asked for (the tag's version, a ``vN`` branch's major version, the registry's range, the lock).
See docs/trust.md.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import hashlib
import logging
import os
import shutil
import stat
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from kernel_hub.errors import (
    HubError,
    IntegrityError,
    KernelHubError,
    SourceError,
    UntrustedSourceError,
)
from kernel_hub.platform import Platform
from kernel_hub.registry.publisher_keys import PublisherKeys
from kernel_hub.registry.registry import OpEntry

from . import cache, index, network, settings
from .client import REPO_TYPE, list_refs
from .digests import (
    METADATA_FILE,
    UNDIGESTED,
    blob_link_target,
    check_tree_shape,
    compare_digests,
    hash_tree,
)
from .json_source import decode
from .lockfile import COMMIT, LockedOp
from .metadata import BuildMetadata, read_metadata
from .network import MissingOnHub
from .signing import signature_path, verify_signature
from .transfer import (
    MAX_FILE_BYTES,
    MAX_METADATA_BYTES,
    MAX_SIGNATURE_BYTES,
    MAX_VARIANT_BYTES,
    check_name,
    fetch_bytes,
    fetch_file,
)
from .trust import TrustRemoteCode, check_trusted
from .variants import Variant, select_variant
from .versions import major_of_branch, parse_range, select_version, tag_name, version_of_tag

logger = logging.getLogger(__name__)
_said_unreachable: set[str] = set()
"""Hubs this process already said it could not reach (said once each)."""


@dataclass(frozen=True)
class HubRequest:
    """Which build of ``repo``: a version range, or a revision (branch, tag or commit id)."""

    repo: str
    spec: SpecifierSet | None = None
    revision: str | None = None
    allowed: SpecifierSet | None = None
    """The registry's range, which the signed version of a revision (or lock) must be in too."""

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
            return cls(entry.repo, revision=revision, allowed=entry.version)
        if entry.commit is not None or entry.revision is not None:
            return cls(entry.repo, revision=entry.commit or entry.revision, allowed=entry.version)
        return cls(entry.repo, spec=entry.version)

    def range(self) -> SpecifierSet | None:
        """The versions this request accepts, whatever the revision resolves to."""
        return self.spec if self.spec is not None else self.allowed


@dataclass(frozen=True)
class Resolved:
    commit: str
    ref: str
    """The tag or branch name it was resolved through (the cache records it), or the commit."""
    version: Version | None
    """The version its tag names, when resolved through a version tag."""
    allowed: SpecifierSet | None = None
    """The versions the signed build may be (the request's range, a ``vN`` branch's major)."""

    @classmethod
    def of(cls, commit: str, ref: str, request: HubRequest) -> Resolved:
        """``ref`` -> ``commit`` for ``request``: what the build there must be is fixed now."""
        allowed = request.range()
        major = major_of_branch(ref)
        if major is not None:
            branch = SpecifierSet(f">={major},<{major + 1}")
            allowed = branch if allowed is None else allowed & branch
        return cls(commit, ref, version_of_tag(ref), allowed)

    def check(self, version: Version) -> None:
        """Refuse a signed ``version`` other than what the tag, branch or range asked for."""
        if self.version is not None and version != self.version:
            kind = "tag " if version_of_tag(self.ref) == self.version else ""
            raise IntegrityError(
                f"{kind}{self.ref} holds a build of version {version}, not {self.version}"
            )
        if self.allowed is not None and not self.allowed.contains(version, prereleases=True):
            raise IntegrityError(
                f"{self.ref} holds version {version}, outside the versions asked for "
                f"({self.allowed})"
            )


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
    verified_copy: Path
    """This process's private copy of the verified bytes: import from here, not from ``path``."""

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
        request = _locked_request(request, locked, what)
    if platform is None:
        from kernel_hub.platform import host_platform

        platform = host_platform()
    requested_variant = variant or settings.variant_override()
    online = not settings.offline()
    with network.deadline():
        if online:
            try:
                resolved = bind_to_index(
                    request.repo, resolve_online(request, what), request, keys, True, what
                )
                listing = list_build(request.repo, resolved.commit, what)
            except network.Unreachable as unreachable:
                online = False
                resolved = _resolve_unreachable(request, keys, what, unreachable)
                listing = cache.cached_variants(request.repo, resolved.commit)
        else:
            resolved = bind_to_index(
                request.repo, resolve_offline(request, what), request, keys, False, what
            )
            listing = cache.cached_variants(request.repo, resolved.commit)
        keys = index.with_learned_revocations(keys)
        chosen = _select(listing, platform, requested_variant, what)
        # One process or thread at a time downloads, verifies or discards this variant.
        with _variant_lock(request.repo, resolved.commit, chosen.name, what):
            if online:
                download(request.repo, resolved, [chosen.name], locked, keys, what)
            build = verify_or_discard(
                request.repo, resolved, chosen.name, locked, keys, what=what, copy=True
            )
            if online:
                _record_ref(request.repo, resolved)
    path = cache.snapshot_dir(request.repo, resolved.commit) / "build" / chosen.name
    return HubBuild(
        request.repo, resolved.commit, chosen.name, path, build.metadata, build.key, build.copy
    )


def _resolve_unreachable(
    request: HubRequest, keys: PublisherKeys, what: str, unreachable: network.Unreachable
) -> Resolved:
    """No connection to the hub: resolve from the cache as ``HF_HUB_OFFLINE=1`` would (the build
    is verified as on every load), saying so once per hub; nothing cached: the ``unreachable``
    error."""
    try:
        resolved = bind_to_index(
            request.repo, resolve_offline(request, what), request, keys, False, what
        )
    except KernelHubError:
        raise unreachable from None
    endpoint = settings.endpoint()
    if endpoint not in _said_unreachable:
        _said_unreachable.add(endpoint)
        logger.warning(
            "%s; loading cached builds from %s instead (verified as on every load; set "
            "HF_HUB_OFFLINE=1 to skip the hub)",
            unreachable,
            settings.cache_dir(),
        )
    return resolved


def _variant_lock(repo: str, commit: str, variant: str, what: str):
    """``cache.variant_lock``, waited for no longer than the fetch's deadline."""
    return cache.variant_lock(
        repo,
        commit,
        variant,
        timeout=network.remaining(what),
        expired=lambda detail: network.deadline_error(f"{what}: {detail}"),
    )


def _locked_request(request: HubRequest, locked: LockedOp, what: str) -> HubRequest:
    """The lock's commit, bound to its version; a lock found in the working directory (not named
    by the user) must also stay inside the registry's range."""
    allowed = request.range()
    if (
        not locked.explicit
        and allowed is not None
        and not allowed.contains(locked.version, prereleases=True)
    ):
        raise HubError(
            f"{what}: the lock file pins {request.repo} {locked.version}, outside the "
            f"registry's range {allowed}; name the lock explicitly (lock=PATH or "
            "$KERNEL_HUB_LOCK) to use it anyway, or re-run 'kernel-hub lock'"
        )
    return HubRequest(request.repo, revision=locked.commit, allowed=None)


def bind_to_index(
    repo: str,
    resolved: Resolved,
    request: HubRequest | None,
    keys: PublisherKeys,
    online: bool,
    what: str,
) -> Resolved:
    """When the registry requires the publisher's signed index (``index: true``): the commit
    must be listed there, and the build is bound to the listed version; online, a range or
    ``vN`` branch ``request`` must have resolved to the newest listed version that fits (a hub
    hiding newer versions is caught). Offline, the cache cannot be frozen by a hub, so an older
    cached version in range stays loadable until the index expires."""
    if not keys.index:
        return resolved
    org = repo.split("/", 1)[0]
    signed = index.current_index(org, index_keys(repo, keys, what), online=online, what=what)
    listed = signed.kernels.get(repo, {})
    version = next((v for v, commit in listed.items() if commit == resolved.commit), None)
    where = f"{what}: {resolved.ref} is commit {resolved.commit[:12]}"
    if version is None:
        raise IntegrityError(f"{where}, which {signed.describe()} does not list")
    if resolved.version is not None and resolved.version != version:
        raise IntegrityError(f"{where}, which {signed.describe()} lists as version {version}")
    newest_wanted = request is not None and (
        request.spec is not None or major_of_branch(resolved.ref) is not None
    )
    if online and newest_wanted:
        fitting = [
            v
            for v in listed
            if resolved.allowed is None or resolved.allowed.contains(v, prereleases=True)
        ]
        if not fitting:
            raise IntegrityError(
                f"{what}: the hub resolved {resolved.ref} to {version}, but {signed.describe()} "
                f"lists no version in {resolved.allowed}: the hub relabelled {resolved.ref}"
            )
        if max(fitting) != version:
            raise IntegrityError(
                f"{what}: the hub resolved {resolved.ref} to {version}, but {signed.describe()} "
                f"lists {max(fitting)} as the newest in {resolved.allowed}: the hub is frozen "
                "or rolled back"
            )
    return dataclasses.replace(resolved, version=version)


def index_keys(repo: str, keys: PublisherKeys, what: str) -> PublisherKeys:
    """The keys that sign ``repo``'s organisation's index: the organisation's registry entry
    only (a key pinned for one repo must not sign what every kernel of the org is checked
    against)."""
    if keys.index_keys is None or not keys.index_keys.keys:
        org = repo.split("/", 1)[0]
        raise UntrustedSourceError(
            f"{what}: the registry requires {org}'s signed index for {repo}, but pins no key for "
            f"the organisation {org!r}; only keys pinned for the organisation sign its index: "
            f"add 'publishers: {{{org}: {{keys: [ed25519:...]}}}}' to the registry"
        )
    return keys.index_keys


def _record_ref(repo: str, resolved: Resolved) -> None:
    if resolved.ref != resolved.commit:
        cache.write_ref(repo, resolved.ref, resolved.commit)


def fetch_all_variants(
    repo: str,
    resolved: Resolved,
    keys: PublisherKeys,
    what: str,
    locked: LockedOp | None = None,
    *,
    copy: bool = False,
) -> dict[str, VerifiedBuild]:
    """Download and verify every variant of a resolved commit (for locks and mirrors); each
    result carries the digests of the one read that was verified (``copy``: and this process's
    private copy of those bytes)."""
    with network.deadline():
        return _fetch_all_variants(repo, resolved, keys, what, locked, copy)


def _fetch_all_variants(repo, resolved, keys, what, locked, copy) -> dict[str, VerifiedBuild]:
    resolved = bind_to_index(repo, resolved, None, keys, True, what)
    keys = index.with_learned_revocations(keys)
    variants = sorted(list_build(repo, resolved.commit, what))
    if not variants:
        raise HubError(f"{what}: {repo} at {resolved.commit[:12]} has no build/<variant>/ folders")
    with contextlib.ExitStack() as held:
        for variant in variants:  # always in the same order: no two fetchers wait on each other
            held.enter_context(_variant_lock(repo, resolved.commit, variant, what))
        download(repo, resolved, variants, locked, keys, what)
        verified = {
            variant: verify_or_discard(repo, resolved, variant, locked, keys, what=what, copy=copy)
            for variant in variants
        }
        _record_ref(repo, resolved)
        return verified


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
    copy: bool = False,
) -> VerifiedBuild:
    """``verify_variant`` on the cached variant (``copy``: also make this process's private copy
    to import from). A forged or damaged variant is removed from the cache; a genuine one that is
    not what was asked for stays (another request may want it), and the ref that led here to it
    is forgotten."""
    path = cache.snapshot_dir(repo, resolved.commit) / "build" / variant
    try:
        build = verify_build(path, variant, repo=repo, keys=keys, copy=copy)
    except (IntegrityError, SourceError, OSError) as exc:  # OSError: a file vanished or unreadable
        cache.discard_variant(repo, resolved.commit, variant)
        raise _refusal(repo, resolved, variant, exc, what) from None
    try:
        check_wanted(variant, build, resolved, locked)
    except IntegrityError as exc:
        if resolved.ref != resolved.commit:
            cache.forget_ref(repo, resolved.ref, resolved.commit)
        raise IntegrityError(
            f"{what}: refusing {repo} build/{variant} at commit {resolved.commit[:12]}: {exc}. "
            "The build itself verified and stays in the cache for requests that want it."
        ) from None
    return build


def _refusal(repo: str, resolved: Resolved, variant: str, exc: Exception, what: str):
    return IntegrityError(
        f"{what}: refusing {repo} build/{variant} at commit {resolved.commit[:12]}: {exc}. "
        "Nothing of it was kept in the cache."
    )


def _select(available, platform: Platform, requested: str | None, what: str) -> Variant:
    try:
        return select_variant(available, platform, requested)
    except HubError as exc:
        raise HubError(f"{what}: {exc}") from None


def resolve_online(request: HubRequest, what: str) -> Resolved:
    versions, branches, tags = list_refs(request.repo)
    if request.spec is not None:
        version, commit = select_version(versions, request.spec, what=f"{what} ({request.repo})")
        return Resolved.of(commit, tag_name(version), request)
    revision = request.revision
    if COMMIT.match(revision):
        return Resolved.of(revision, revision, request)
    for refs in (tags, branches):
        if revision in refs:
            return Resolved.of(refs[revision], revision, request)
    raise HubError(
        f"{what}: {request.repo} has no branch or tag {revision!r}; branches: "
        f"{', '.join(map(repr, sorted(branches))) or '(none)'}; tags: "
        f"{', '.join(map(repr, sorted(tags))) or '(none)'}"
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
        return Resolved.of(matching[best], tag_name(best), request)
    revision = request.revision
    commit = revision if COMMIT.match(revision) else cache.cached_refs(repo).get(revision)
    if commit is None or not cache.cached_variants(repo, commit):
        raise HubError(
            f"{what}: {repo} revision {revision} is not in the cache; {offline_hint}. "
            "Fetch it once online or unset HF_HUB_OFFLINE"
        )
    return Resolved.of(commit, revision, request)


def list_build(repo: str, commit: str, what: str) -> list[str]:
    """The variants under ``build/`` at ``commit``; any file name escaping ``build/`` is refused."""
    where = f"{what}: listing build/ of {repo} at {commit[:12]}"
    url = network.api_url(REPO_TYPE, repo, "tree", commit, "build") + "?recursive=true"
    variants = set()
    for page in network.get_pages(url, where):
        if not isinstance(page, list) or not all(
            isinstance(e, dict) and isinstance(e.get("path"), str) for e in page
        ):
            raise IntegrityError(f"{where}: the hub answered a malformed listing")
        for entry in page:
            parts = check_name(entry["path"], f"{repo} build/").split("/")
            if parts[0] != "build" or len(parts) < 2:
                raise IntegrityError(
                    f"{what}: refusing file name {entry['path']!r}: it escapes build/"
                )
            if len(parts) > 2:  # inside a variant folder (a loose file in build/ is no variant)
                variants.add(parts[1])
    return sorted(variants)


def download(
    repo: str,
    resolved: Resolved,
    variants: list[str],
    locked: LockedOp | None,
    keys: PublisherKeys,
    what: str,
) -> None:
    """Fetch the ``variants`` not in the cache yet into a private staging folder, verify each
    there, and only then move them into the cache (see :func:`stage_variant`). Called under
    their ``variant_lock``s; on any failure nothing of them is left anywhere."""
    snapshot = cache.snapshot_dir(repo, resolved.commit)
    missing = [
        v
        for v in variants
        if not (snapshot / "build" / v).exists() and not (snapshot / "build" / v).is_symlink()
    ]
    if not missing:
        return
    with cache.staging(repo) as staged:
        for variant in missing:
            try:
                stage_variant(repo, resolved, variant, staged, locked, keys, what)
            except (IntegrityError, SourceError) as exc:
                raise _refusal(repo, resolved, variant, exc, what) from None
        for variant in missing:
            cache.install_variant(repo, resolved.commit, staged, variant)


def stage_variant(
    repo: str,
    resolved: Resolved,
    variant: str,
    staged: Path,
    locked: LockedOp | None,
    keys: PublisherKeys,
    what: str,
) -> None:
    """Download one variant into ``staged`` (``build/<variant>/`` and its signature) and verify it.

    Every name written comes from kernel-hub or the signed digest (checked), never from a
    response header; metadata.json is parsed only after its signature verified; a file is
    downloaded only if the signed digest lists it, and stops at its signed size.
    """
    commit, label = resolved.commit, f"build/{variant}"
    where = f"{what}: downloading {repo} {resolved.ref}"
    folder = staged / "build" / variant
    signature_file = staged / signature_path(variant)
    try:
        signature = fetch_bytes(
            repo, commit, signature_path(variant), limit=MAX_SIGNATURE_BYTES, where=where
        )
    except MissingOnHub:
        raise IntegrityError(
            f"the build is not signed (the hub has no {signature_path(variant)})"
        ) from None
    metadata_bytes = fetch_bytes(
        repo, commit, f"{label}/{METADATA_FILE}", limit=MAX_METADATA_BYTES, where=where
    )
    if locked is not None:  # the lock covers metadata.json: checked before anything else
        pinned = locked.variants.get(variant, {}).get(METADATA_FILE)
        if pinned is not None and pinned != _digest(metadata_bytes):
            raise IntegrityError(
                f"{label} does not match the lock; changed: {label}/{METADATA_FILE}"
            )
    verify_signature(
        signature_file,
        metadata_bytes,
        repo=repo,
        variant=variant,
        keys=keys,
        text=decode(signature_file, signature),
    )
    metadata = read_metadata(folder / METADATA_FILE, decode(folder, metadata_bytes))
    total = len(metadata_bytes)
    for name, digest in sorted(metadata.digest.items()):
        if check_name(name, label) in UNDIGESTED:
            raise IntegrityError(f"the digest lists {label}/{name}, which it cannot cover")
        limit = metadata.sizes[name] if metadata.sizes is not None else MAX_FILE_BYTES
        if total + limit > MAX_VARIANT_BYTES:
            raise IntegrityError(f"{label} is larger than {MAX_VARIANT_BYTES} bytes")
        total += fetch_file(
            repo, commit, f"{label}/{name}", folder / name, limit=limit, digest=digest, where=where
        )
    folder.mkdir(parents=True, exist_ok=True)
    (folder / METADATA_FILE).write_bytes(metadata_bytes)
    signature_file.parent.mkdir(parents=True, exist_ok=True)
    signature_file.write_bytes(signature)
    verify_variant(folder, variant, resolved, locked, repo=repo, keys=keys)


def read_capped(path: Path, limit: int) -> bytes:
    """A regular file's bytes, refused (before anything parses them) when over ``limit``; a
    planted FIFO or device is refused without waiting on it or reading it."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise IntegrityError(f"{path.name} is not a regular file; not reading it")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise IntegrityError(f"{path.name} is larger than {limit} bytes; not parsing it")
    return data


def verify_variant(
    path: Path,
    variant: str,
    resolved: Resolved,
    locked: LockedOp | None,
    *,
    repo: str,
    keys: PublisherKeys,
) -> tuple[BuildMetadata, str]:
    """:func:`verify_build`, then :func:`check_wanted`; returns the metadata and the key's id."""
    build = verify_build(path, variant, repo=repo, keys=keys)
    check_wanted(variant, build, resolved, locked)
    return build.metadata, build.key


@dataclass(frozen=True)
class VerifiedBuild:
    metadata: BuildMetadata
    key: str
    digests: dict[str, str]
    """Every file's digest (metadata.json included), from the one read that was checked."""
    copy: Path | None
    """This process's private copy of the files, written from the bytes hashed (``copy=True``)."""
    signature: bytes
    """The signature file's bytes, as verified."""


def verify_build(
    path: Path, variant: str, *, repo: str, keys: PublisherKeys, copy: bool = False
) -> VerifiedBuild:
    """Is this variant folder a genuine build, before any of it is imported: only plain files (or
    an older cache's links to its blobs), the signature over metadata.json by a pinned key, every
    file against the signed digest. Each file is read once: the bytes hashed are the bytes parsed
    (metadata.json) and, with ``copy``, the bytes written to this process's private copy, which
    is what gets imported. A folder that fails this is damaged or forged, and is discarded."""
    label = f"build/{variant}"
    if not path.is_dir():
        raise IntegrityError(f"{label} is not in the cache")
    signature_file = path.parent.parent / signature_path(variant)
    # every folder down to the build and its signature a real one of this user's: the shape
    # check below deletes bytecode and the refusal of a bad build deletes the build
    cache.checked_dir(path, create=False)
    cache.checked_dir(signature_file.parent, create=False)
    blobs = cache.repo_cache_dir(repo) / "blobs"
    check_tree_shape(path, label=label, links_into=blobs)
    metadata_file = path / METADATA_FILE
    try:
        metadata_bytes = read_capped(metadata_file, MAX_METADATA_BYTES)
    except FileNotFoundError:
        raise IntegrityError(f"{label}/{METADATA_FILE} is missing") from None
    signature = _read_signature_file(signature_file, blobs)
    verified = verify_signature(
        signature_file,
        metadata_bytes,
        repo=repo,
        variant=variant,
        keys=keys,
        text=decode(signature_file, signature),
    )
    metadata = read_metadata(metadata_file, decode(metadata_file, metadata_bytes))
    if str(metadata.version) != verified.version:
        raise IntegrityError(
            f"{label}/metadata.json says version {metadata.version} but was signed as "
            f"{verified.version}"
        )
    if metadata.variant != variant:
        raise IntegrityError(f"{label}/metadata.json describes variant {metadata.variant!r}")
    target = None
    if copy:
        digest_hex = hashlib.sha256(metadata_bytes).hexdigest()
        target = cache.verified_copy_dir(repo, path.parent.parent.name, variant, digest_hex)
    digests = _hash_and_copy(path, target, metadata.digest, metadata_bytes, label)
    return VerifiedBuild(metadata, verified.key, digests, target, signature)


def _read_signature_file(path: Path, blobs: Path) -> bytes:
    """The signature's bytes: a regular file (or an older cache's link to a blob), capped."""
    name = f"{path.parent.name}/{path.name}"
    if path.is_symlink() and blob_link_target(path, blobs) is None:
        raise IntegrityError(
            f"refusing {name}: a symlink to {os.readlink(path)}, outside the build's files"
        )
    try:
        return read_capped(path, MAX_SIGNATURE_BYTES)
    except FileNotFoundError:
        raise IntegrityError(f"{name}: the build is not signed (no signature file)") from None


def _hash_and_copy(
    path: Path, target: Path | None, signed: Mapping[str, str], metadata: bytes, label: str
) -> dict[str, str]:
    """Hash every file of ``path`` once (writing those bytes to ``target`` unless this process
    already holds that copy) and compare with the signed digests."""
    staged = None
    if target is not None and not target.is_dir():
        target.parent.mkdir(parents=True, exist_ok=True)
        staged = Path(tempfile.mkdtemp(prefix=".copy-", dir=target.parent))
    try:
        digests = hash_tree(path, with_metadata=True, copy_to=staged)
        if digests.get(METADATA_FILE) != _digest(metadata):
            raise IntegrityError(f"{label}/{METADATA_FILE} changed while it was being verified")
        compare_digests(digests, signed, label=label)
        if staged is not None:
            with contextlib.suppress(OSError):  # another thread made the same copy first
                os.rename(staged, target)
    finally:
        if staged is not None:
            shutil.rmtree(staged, ignore_errors=True)
    return digests


def check_wanted(
    variant: str, build: VerifiedBuild, resolved: Resolved, locked: LockedOp | None
) -> None:
    """Is a genuine build the one asked for: the signed version against the tag, branch or range,
    and the lock's version and digests (compared with the digests of the one read that was
    verified). A build that fails only this is valid (another request may want it) and is never
    discarded for it."""
    resolved.check(build.metadata.version)
    if locked is None:
        return
    files = locked.variants.get(variant)
    if files is None:
        raise IntegrityError(
            f"the lock has no digests for variant {variant} "
            f"(it has {', '.join(locked.variants)}); re-run 'kernel-hub lock'"
        )
    compare_digests(build.digests, files, label=f"build/{variant}")
    if build.metadata.version != locked.version:
        raise IntegrityError(
            f"the lock pins version {locked.version} but the build is {build.metadata.version}"
        )


def _digest(data: bytes) -> str:
    return base64.b64encode(hashlib.sha256(data).digest()).decode("ascii")
