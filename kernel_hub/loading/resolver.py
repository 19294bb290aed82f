"""``get_kernel``: op name -> registry entry -> a kernel build on disk -> loaded module.

Where the build comes from, first match wins:

1. a local directory: ``local_dir=`` or ``$KERNEL_HUB_LOCAL_KERNELS`` (``op=/path,...``), for kernel
   development; it holds a ``kernel.yaml`` or is a build folder with ``<variant>/`` folders;
2. ``source="local"`` / ``"hub"``, else ``$KERNEL_HUB_SOURCE``;
3. otherwise the hub only when something asks for a hub build (``version=``, ``revision=``, or a
   lock file pinning the op), else the in-tree kernel (``kernels/<kernel>`` beside the registry,
   else the built-in one; :mod:`kernel_hub.paths`). So a plain
   ``get_kernel("rmsnorm")`` keeps working with no network.

A hub build is resolved from the registry's ``repo`` and ``commit``/``revision``/``version`` (the
``version=``/``revision=`` arguments override them; a lock file pins the commit), fetched into the
Hugging Face cache, verified, then imported by the same loader as in-tree kernels
(:func:`kernel_hub.loading.loader.load_kernel_dir`). See :mod:`kernel_hub.hub`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from kernel_hub.bridge.threads import apply_default_policy
from kernel_hub.errors import (
    HubError,
    KernelHubError,
    KernelInputError,
    SourceError,
    UntrustedSourceError,
)
from kernel_hub.hub import settings
from kernel_hub.hub.fetch import HubBuild, HubRequest, fetch_build
from kernel_hub.hub.lockfile import LockedOp, LockFile, find_lock
from kernel_hub.hub.trust import TrustRemoteCode, check_trusted
from kernel_hub.hub.variants import VARIANT_NAMES, select_variant
from kernel_hub.hub.versions import parse_range
from kernel_hub.paths import kernel_dir_for
from kernel_hub.registry.manifest import MANIFEST_NAME, load_manifest
from kernel_hub.registry.publisher_keys import PublisherKeys
from kernel_hub.registry.registry import OpEntry, load_registry

from .loader import load_kernel_dir


@dataclass(frozen=True)
class KernelOrigin:
    """Where a loaded kernel came from (``module.origin``)."""

    source: str
    """``in-tree``, ``local`` (a directory override) or ``hub``."""
    path: Path
    repo: str | None = None
    commit: str | None = None
    variant: str | None = None


def in_tree_dir(entry: OpEntry) -> Path:
    """The in-tree build of an op: ``kernels/<kernel>`` beside its registry, else built in."""
    return kernel_dir_for(entry.source, entry.kernel)


def get_kernel(
    name: str,
    *,
    registry: str | Path | None = None,
    source: str | None = None,
    version: str | int | None = None,
    revision: str | None = None,
    local_dir: str | Path | None = None,
    lock: str | Path | bool | None = None,
    variant: str | None = None,
    trust_remote_code: TrustRemoteCode = False,
) -> ModuleType:
    """Load the kernel that provides op ``name`` (or an alias) and return its module.

    The module exposes the torch ops, ``.jax`` (the JAX functions), ``.layers``, ``.manifest`` and
    ``.origin``. Its implementation order per platform is set from the registry entry.

    ``version`` is a range (``">=1.2,<2"``), an exact ``"1.2.0"`` or a major version (int);
    ``revision`` a hub branch, tag or commit. ``lock`` is a lock file path, False to ignore lock
    files, or None to use ``$KERNEL_HUB_LOCK`` / ``./kernel-hub.lock`` when present. ``variant``
    forces a build variant (default: the one for this machine). Downloaded code is imported only
    from trusted publishers or with ``trust_remote_code`` (True, or a list of orgs / repo ids).
    """
    registry_file = load_registry(registry)
    if not isinstance(name, str):
        raise KernelInputError(
            f"get_kernel: name must be an op name (str), got {type(name).__name__} {name!r}; "
            f"ops: {', '.join(registry_file.ops)}"
        )
    if variant is not None and variant not in VARIANT_NAMES:
        raise KernelInputError(
            f"get_kernel: unknown build variant {variant!r}; valid variants: "
            f"{', '.join(VARIANT_NAMES)}"
        )
    entry = registry_file.get(name)
    override = Path(local_dir) if local_dir is not None else _env_override(entry, name)
    if override is not None:
        path = _local_kernel_dir(override, variant)
        module = load_kernel_dir(path)
        origin = KernelOrigin("local", path)
    else:
        # An explicit local source never reads a lock file (it pins hub builds only).
        lock_file = None if (source or settings.source()) == "local" else find_lock(lock)
        locked = lock_file.ops.get(entry.name) if lock_file is not None else None
        chosen = _choose_source(source, version, revision, locked)
        if chosen == "local":
            if version is not None or revision is not None:
                raise KernelHubError(
                    f"op {entry.name}: version=/revision= select hub builds, but source is 'local'"
                )
            module = load_kernel_dir(in_tree_dir(entry))
            _check_version(entry, module)
            origin = KernelOrigin("in-tree", in_tree_dir(entry))
        else:
            build = fetch_op_build(
                entry,
                version=version,
                revision=revision,
                lock_file=lock_file,
                variant=variant,
                trust_remote_code=trust_remote_code,
                keys=registry_file.keys_for(entry.repo) if entry.repo else None,
            )
            module, origin = _load_hub_build(build, entry)
    _apply_implementation_order(entry, module)
    module.origin = origin
    return module


def _refuse_unverifiable(
    entry: OpEntry, keys: PublisherKeys | None, version: str | int | None
) -> None:
    """A registry that pins no key for the repo's publisher can load none of its hub builds.
    Say so before any download, and whether the in-tree kernel already is what was asked for:
    asking the built-in registry for the in-tree version is the usual way to get here."""
    if entry.repo is None or (keys is not None and keys.keys):
        return
    org = entry.repo.split("/", 1)[0]
    in_tree_version = load_manifest(in_tree_dir(entry)).version
    in_tree = f"{entry.kernel} {in_tree_version}"
    if version is not None and parse_range(version).contains(in_tree_version, prereleases=True):
        what_to_do = (
            f"The in-tree kernel {in_tree} matches version {str(version)!r} and needs no hub: ask "
            f"for no version (get_kernel({entry.name!r}), or no kernel_mapping version) to load it"
        )
    else:
        what_to_do = f"get_kernel({entry.name!r}) loads the in-tree kernel {in_tree}"
    raise UntrustedSourceError(
        f"op {entry.name}: no hub build can be loaded: the registry in use ({entry.source}) pins "
        f"no signing key for {entry.repo}'s publisher {org!r} (the built-in registry pins none: no "
        "signed "
        f"kernel-hub builds are published). {what_to_do}. To load your own signed builds, pin "
        "your publisher key under 'publishers:' in your registry (docs/hub-walkthrough.md)"
    )


def _env_override(entry: OpEntry, name: str) -> Path | None:
    overrides = settings.local_kernel_overrides()
    for key in (entry.name, name, *entry.aliases):
        if key in overrides:
            return overrides[key]
    return None


def _local_kernel_dir(path: Path, variant: str | None) -> Path:
    """A kernel directory (``kernel.yaml`` inside), or the variant of a build folder for here."""
    if (path / MANIFEST_NAME).is_file():
        return path
    build = path / "build" if (path / "build").is_dir() else path
    variants = (
        [p.name for p in build.iterdir() if (p / MANIFEST_NAME).is_file()] if build.is_dir() else []
    )
    if not variants:
        raise KernelHubError(
            f"local kernel directory {path} holds neither {MANIFEST_NAME} nor build variant folders"
        )
    from kernel_hub.platform import host_platform

    return (
        build
        / select_variant(variants, host_platform(), variant or settings.variant_override()).name
    )


def _choose_source(
    source: str | None, version: object, revision: object, locked: LockedOp | None
) -> str:
    chosen = source or settings.source()
    if chosen is None:
        return (
            "hub" if version is not None or revision is not None or locked is not None else "local"
        )
    if chosen not in settings.SOURCES:
        raise KernelHubError(f"source={chosen!r}; valid sources: {', '.join(settings.SOURCES)}")
    return chosen


def fetch_op_build(
    entry: OpEntry,
    *,
    version: str | int | None = None,
    revision: str | None = None,
    lock_file: LockFile | None = None,
    variant: str | None = None,
    trust_remote_code: TrustRemoteCode = False,
    keys: PublisherKeys | None,
) -> HubBuild:
    """The verified hub build ``get_kernel`` would import for ``entry`` (downloaded if needed);
    ``keys``: the registry's pinned signing keys for its repo."""
    request = HubRequest.for_op(entry, version, revision)
    locked = lock_file.ops.get(entry.name) if lock_file is not None else None
    if locked is not None:
        if version is not None or revision is not None:
            raise HubError(
                f"op {entry.name} is pinned by {lock_file.path} to {locked.version} "
                f"({locked.commit[:12]}); pass lock=False to choose another version= or revision="
            )
        if locked.repo != entry.repo:
            raise HubError(
                f"op {entry.name}: {lock_file.path} pins repo {locked.repo} but the registry names "
                f"{entry.repo}; re-run 'kernel-hub lock'"
            )
    check_trusted(entry.repo, trust_remote_code)  # fetch_build's order: publisher, then keys
    _refuse_unverifiable(entry, keys, version)
    # fetch_build asks JAX which platform this is, which starts its backends: the bridge's thread
    # policy must be in place first, or it never applies in this process
    apply_default_policy()
    return fetch_build(
        request,
        what=f"op {entry.name}",
        variant=variant,
        trust_remote_code=trust_remote_code,
        locked=locked,
        keys=keys,
    )


def _load_hub_build(build: HubBuild, entry: OpEntry) -> tuple[ModuleType, KernelOrigin]:
    module = load_kernel_dir(build.verified_copy)  # the bytes verified, not the shared cache
    if module.manifest.version != build.version:
        raise HubError(
            f"op {entry.name}: {build.path} has kernel.yaml version {module.manifest.version} "
            f"but metadata.json says {build.version}"
        )
    return module, KernelOrigin("hub", build.path, build.repo, build.commit, build.variant)


def _check_version(entry: OpEntry, module: ModuleType) -> None:
    version = module.manifest.version
    if not entry.version.contains(version, prereleases=True):
        raise KernelHubError(
            f"op {entry.name}: registry asks for version {entry.version} but "
            f"{in_tree_dir(entry)} holds {version}"
        )


def check_entry(entry: OpEntry, module: ModuleType) -> None:
    """``SourceError`` at the registry line naming an implementation the kernel does not have or
    does not run on that platform, or a layer it does not declare, with the valid names."""
    manifest, declared = module.manifest, module.KERNEL
    label = f"op {entry.name!r}: kernel {manifest.name} {manifest.version}"
    for platform, names in entry.implementations.items():
        valid = manifest.implementations_on(platform)
        for name in names:
            if name in valid:
                continue
            if name in manifest.implementations:
                runs_on = ", ".join(manifest.implementations[name])
                problem = f"implementation {name!r} does not run on {platform} (only {runs_on})"
            else:
                problem = f"has no implementation {name!r}"
            raise SourceError(
                entry.source,
                entry.line_for(f"implementations.{platform}"),
                f"{label} {problem}; valid on {platform}: {', '.join(valid) or '(none)'}",
            )
    unknown = [name for name in entry.layers if name not in declared.layers]
    if unknown:
        raise SourceError(
            entry.source,
            entry.line_for("layers"),
            f"{label} has no layer {unknown[0]!r}; its layers: "
            f"{', '.join(declared.layers) or '(none)'}",
        )


def _apply_implementation_order(entry: OpEntry, module: ModuleType) -> None:
    """Each implementation table tries the registry's names for a platform in its order (a
    kernel's tables may each implement a subset of the kernel's names)."""
    check_entry(entry, module)
    for table in module.KERNEL.implementation_tables:
        for platform, names in entry.implementations.items():
            table.set_order(platform, [n for n in names if n in table.names])
