"""``kernel-hub build``: an in-tree kernel (``kernels/<name>``) -> ``build/<variant>/`` folders.

Each variant folder is loadable by kernel-hub's loader (``kernel.yaml`` + package folder) and, for
``torch-*`` variants, by Hugging Face ``kernels`` (``metadata.json`` + ``<name>/__init__.py``):

    build/torch-cpu/
        kernel.yaml        the kernel manifest, ``requires`` extended for this variant
        rmsnorm/           the package (bytecode left out)
        metadata.json      name, versions, backend, requirements, ops, layers, per-file digest

The build is written to a temporary folder beside ``build/`` and swapped in whole, so a failed
build never leaves a half-written one behind.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml

from kernel_hub.errors import KernelHubError
from kernel_hub.registry.manifest import MANIFEST_NAME, Manifest, load_manifest

from .digests import BYTECODE_DIR, METADATA_FILE, check_tree_shape, hash_tree
from .metadata import KERNEL_NAME, make_metadata
from .variants import VARIANTS, Variant, get_variant

BUILD_DIR = "build"


@dataclass(frozen=True)
class Build:
    """A finished build: ``path`` holds one folder per variant."""

    path: Path
    manifest: Manifest
    variants: Mapping[str, dict]
    """Variant name -> its metadata.json content."""


def build_kernel(
    kernel_dir: str | Path, out_dir: str | Path | None = None, variants: Iterable[str] | None = None
) -> Build:
    """Build ``kernel_dir`` into ``out_dir`` (default ``kernel_dir/build``)."""
    kernel_dir = Path(kernel_dir)
    manifest = load_manifest(kernel_dir)
    _check_publishable(manifest, kernel_dir)
    chosen = [get_variant(name) for name in variants] if variants is not None else list(VARIANTS)
    out_dir = Path(out_dir) if out_dir is not None else kernel_dir / BUILD_DIR
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        metadata = {
            v.name: _build_variant(kernel_dir, manifest, v, staging / v.name) for v in chosen
        }
        if out_dir.exists():
            shutil.rmtree(out_dir)
        staging.rename(out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return Build(path=out_dir, manifest=manifest, variants=metadata)


def _check_publishable(manifest: Manifest, kernel_dir: Path) -> None:
    if not KERNEL_NAME.match(manifest.name):
        raise KernelHubError(
            f"{kernel_dir / MANIFEST_NAME}: kernel name {manifest.name!r} cannot be published; "
            "names are lowercase letters, digits and '-', starting with a letter"
        )
    if not (kernel_dir / manifest.package / "__init__.py").is_file():
        raise KernelHubError(f"{kernel_dir}: package folder {manifest.package}/ has no __init__.py")


HF_KERNELS_ENTRY = '''"""Hugging Face `kernels` imports this file (a variant's top-level
__init__.py, else <kernel name as a Python name>/__init__.py); the kernel's package is
{package}/, which it exposes. kernel-hub itself imports {package}/ directly."""

import importlib as _importlib

_package = _importlib.import_module(".{package}", __name__)
globals().update({{k: v for k, v in vars(_package).items() if not k.startswith("__")}})
'''


def _write_hf_kernels_entry(manifest: Manifest, dest: Path) -> None:
    """A top-level ``__init__.py`` exposing the package, where its name is not the kernel name's
    Python form (the attention kernel's ``flash_attention``): ``kernels`` looks only there."""
    if manifest.package != manifest.name.replace("-", "_"):
        entry = HF_KERNELS_ENTRY.format(package=manifest.package)
        (dest / "__init__.py").write_text(entry, encoding="utf-8")


def variant_requires(manifest: Manifest, variant: Variant) -> dict[str, str]:
    requires = {dist: str(spec) for dist, spec in manifest.requires.items()}
    requires.update(variant.extra_requires)
    return requires


def _build_variant(kernel_dir: Path, manifest: Manifest, variant: Variant, dest: Path) -> dict:
    shutil.copytree(
        kernel_dir / manifest.package,
        dest / manifest.package,
        symlinks=True,  # kept as links, so check_tree_shape refuses them: a link could pull in
        ignore=shutil.ignore_patterns(BYTECODE_DIR, "*.pyc"),  # files from outside the kernel
    )
    _write_hf_kernels_entry(manifest, dest)
    check_tree_shape(dest, label=str(kernel_dir))
    requires = variant_requires(manifest, variant)
    source = yaml.safe_load((kernel_dir / MANIFEST_NAME).read_text(encoding="utf-8"))
    source["requires"] = requires
    (dest / MANIFEST_NAME).write_text(yaml.safe_dump(source, sort_keys=False), encoding="utf-8")
    digest = hash_tree(dest)
    sizes = {name: (dest / name).stat().st_size for name in digest}
    metadata = make_metadata(manifest, variant, requires, digest, sizes)
    (dest / METADATA_FILE).write_text(json.dumps(metadata, indent=2) + "\n", encoding="utf-8")
    return metadata
