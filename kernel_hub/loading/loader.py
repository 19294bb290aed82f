"""Import a kernel build as an isolated module.

Each build directory is imported under its own module name (kernel name, version and a hash of its
path), so two versions of one kernel load side by side, and loading the same directory twice
returns the same module.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
import threading
from pathlib import Path
from types import ModuleType

from kernel_hub.declaration import KernelDeclaration
from kernel_hub.errors import KernelHubError, SourceError
from kernel_hub.registry.manifest import MANIFEST_NAME, Manifest, load_manifest

_lock = threading.RLock()


def module_name_for(manifest: Manifest, kernel_dir: Path) -> str:
    digest = hashlib.sha256(str(kernel_dir.resolve()).encode()).hexdigest()[:10]
    version = str(manifest.version).replace(".", "_")
    return f"_kernel_hub_{manifest.package}_{version}_{digest}"


def load_kernel_dir(kernel_dir: str | Path) -> ModuleType:
    """Import the kernel in ``kernel_dir`` (manifest + package); ``module.manifest`` is set and
    ``module.KERNEL`` (its declaration) checked against the manifest."""
    kernel_dir = Path(kernel_dir)
    manifest = load_manifest(kernel_dir)
    manifest.check_requirements()
    name = module_name_for(manifest, kernel_dir)
    with _lock:
        if name in sys.modules:
            return sys.modules[name]
        package_dir = kernel_dir / manifest.package
        init = package_dir / "__init__.py"
        if not init.is_file():
            raise KernelHubError(
                f"{kernel_dir}: manifest names package {manifest.package!r} "
                f"but {init} does not exist"
            )
        spec = importlib.util.spec_from_file_location(
            name, init, submodule_search_locations=[str(package_dir)]
        )
        module = importlib.util.module_from_spec(spec)
        module.manifest = manifest
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
            _attach_declaration(module, manifest)
        except BaseException:
            for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
                del sys.modules[loaded]
            raise
        return module


def _attach_declaration(module: ModuleType, manifest: Manifest) -> None:
    """Check the package's ``KERNEL`` against the manifest: the ops, layers and implementation
    names both state."""
    declared = module.__dict__.get("KERNEL")
    label = f"kernel {manifest.name} {manifest.version}"
    if declared is None:
        raise KernelHubError(
            f"{label}: the package exports no KERNEL; a kernel package declares what kernel-hub "
            "reads from it as KERNEL = kernel_api.KernelDeclaration(...)"
        )
    if not isinstance(declared, KernelDeclaration):
        raise KernelHubError(
            f"{label}: KERNEL is a {type(declared).__name__}, not a kernel_api.KernelDeclaration"
        )
    problems = _mismatches(manifest, "ops", declared.ops)
    problems += _mismatches(manifest, "layers", declared.layers)
    if declared.implementation_tables:
        implemented = {name for table in declared.implementation_tables for name in table.names}
        problems += _mismatches(manifest, "implementations", implemented)
    if problems:
        raise SourceError(
            manifest.path or MANIFEST_NAME,
            problems[0][0],
            f"{label}: the manifest and the package's KERNEL disagree: "
            + "; ".join(message for _, message in problems),
        )


def _mismatches(manifest: Manifest, what: str, declared_names) -> list[tuple[int | None, str]]:
    """(manifest line, problem) for the names of field ``what`` only one side states."""
    stated = getattr(manifest, what)
    only_manifest = sorted(set(stated) - set(declared_names))
    only_declared = sorted(set(declared_names) - set(stated))
    problems = []
    if only_manifest:
        line = manifest.line_for(f"{what}.{only_manifest[0]}") or manifest.line_for(what)
        problems.append((line, f"{what} {', '.join(only_manifest)} in the manifest, not declared"))
    if only_declared:
        problems.append(
            (
                manifest.line_for(what),
                f"{what} {', '.join(only_declared)} declared, not in the manifest",
            )
        )
    return problems
