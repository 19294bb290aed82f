"""``kernel-hub publish``: build a kernel and upload it as version ``vX.Y.Z`` of a hub repo.

One commit on ``main`` replaces ``build/`` with the new build; the tag ``vX.Y.Z`` marks it and the
branch ``vX`` is moved to it when it is the highest ``X.*`` version (the ``kernels`` convention, so
``kernels.get_kernel(repo, version=X)`` finds it). A version whose tag exists is refused: published
versions are immutable.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from packaging.version import Version

from kernel_hub.errors import HubError
from kernel_hub.registry.publisher_keys import PublisherKeys, key_id

from .build import Build, build_kernel
from .client import REPO_TYPE, hub_api, hub_errors, list_refs
from .index import publish_index
from .recovery import vet_listed
from .signing import SIGNATURE_DIR, SigningKey, sign_variant, signature_path
from .versions import branch_name, tag_name


@dataclass(frozen=True)
class Published:
    repo: str
    version: Version
    commit: str
    tag: str
    branch: str | None
    """The ``vX`` branch if it was moved to this commit (not for a back-ported older version)."""
    build: Build
    signed_by: str | None
    """Id of the key the variants were signed with (None: unsigned)."""


def publish_kernel(
    kernel_dir: str | Path,
    repo: str,
    *,
    sign_key: str | Path | Sequence[str | Path] | None,
    build_dir: str | Path | None = None,
    token: str | bool | None = None,
    index: PublisherKeys | None = None,
) -> Published:
    """Build, sign each variant with ``sign_key`` (a ``kernel-hub keygen`` private key, or several
    for a registry ``threshold``; None publishes unsigned builds, which kernel-hub refuses to
    load) and upload. ``index``: also add the version to the publisher's signed index
    (:mod:`.index`), whose current state must verify against these keys (the registry's for the
    org; the signing keys are always accepted)."""
    if index is not None and sign_key is None:
        raise HubError("the publisher's index can only be updated with --sign-key")
    if repo.count("/") != 1 or not all(repo.split("/")):
        raise HubError(f"--repo must be 'org/name', got {repo!r}")
    paths = [sign_key] if isinstance(sign_key, (str, Path)) else list(sign_key or ())
    signers = [SigningKey(path) for path in paths]
    build = build_kernel(kernel_dir, build_dir)
    version = build.manifest.version
    signatures = {
        signature_path(v): sign_variant(signers, build.path / v, repo, str(version), v)
        for v in build.variants
        if signers
    }
    tag = tag_name(version)
    what = f"publishing {build.manifest.name} {version} to {repo}"
    api = hub_api(token)
    with hub_errors(what):
        api.create_repo(repo, repo_type=REPO_TYPE, exist_ok=True)
    versions, branches, tags = list_refs(repo, token)
    if tag in tags:
        raise HubError(
            f"{what}: version {version} is already published (tag {tag} -> {tags[tag][:12]}); "
            "published versions are immutable, bump 'version' in kernel.yaml"
        )
    head = branches.get("main")
    with hub_errors(what):
        commit = api.create_commit(
            repo,
            _operations(api, repo, head, build.path, signatures),
            commit_message=f"{build.manifest.name} {version}",
            repo_type=REPO_TYPE,
            parent_commit=head,
        ).oid
        api.create_tag(repo, tag=tag, revision=commit, repo_type=REPO_TYPE)
    newer = [v for v in versions if v.major == version.major and v > version]
    branch = None
    if not newer:
        branch = branch_name(version)
        with hub_errors(f"{what}: moving branch {branch}"):
            if branch in branches:
                api.delete_branch(repo, branch=branch, repo_type=REPO_TYPE)
            api.create_branch(repo, branch=branch, revision=commit, repo_type=REPO_TYPE)
    if index is not None:
        org = repo.split("/", 1)[0]
        trusted = replace(index, keys=(*index.keys, *(k.public_key for k in signers)))
        vet = vet_listed(lambda _repo: trusted, what)
        publish_index(org, signers, trusted, add={repo: (version, commit)}, vet=vet, token=token)
    signed_by = key_id(signers[0].public_key) if signers else None
    return Published(repo, version, commit, tag, branch, build, signed_by)


def _operations(
    api, repo: str, head: str | None, build_path: Path, signatures: dict[str, bytes]
) -> list:
    """Add every file of the build under ``build/`` and the signatures; delete old build files
    and signatures they do not replace."""
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete
    from huggingface_hub.hf_api import RepoFile

    adds = [
        CommitOperationAdd(
            path_in_repo=f"build/{path.relative_to(build_path).as_posix()}", path_or_fileobj=path
        )
        for path in sorted(build_path.rglob("*"))
        if path.is_file()
    ] + [CommitOperationAdd(path_in_repo=p, path_or_fileobj=data) for p, data in signatures.items()]
    new = {op.path_in_repo for op in adds}
    old = []
    if head is not None:
        with hub_errors(f"listing files of {repo}"):
            old = [
                entry.path
                for entry in api.list_repo_tree(
                    repo, recursive=True, revision=head, repo_type=REPO_TYPE
                )
                if isinstance(entry, RepoFile)
                and entry.path.startswith(("build/", f"{SIGNATURE_DIR}/"))
            ]
    return [CommitOperationDelete(path_in_repo=p) for p in old if p not in new] + adds
