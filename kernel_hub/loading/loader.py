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

from kernel_hub.errors import KernelHubError
from kernel_hub.registry.manifest import Manifest, load_manifest

_lock = threading.RLock()


def module_name_for(manifest: Manifest, kernel_dir: Path) -> str:
    digest = hashlib.sha256(str(kernel_dir.resolve()).encode()).hexdigest()[:10]
    version = str(manifest.version).replace(".", "_")
    return f"_kernel_hub_{manifest.package}_{version}_{digest}"


def load_kernel_dir(kernel_dir: str | Path) -> ModuleType:
    """Import the kernel in ``kernel_dir`` (manifest + package); ``module.manifest`` is set."""
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
        except BaseException:
            for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
                del sys.modules[loaded]
            raise
        _check_exports(module, manifest)
        return module


def _check_exports(module: ModuleType, manifest: Manifest) -> None:
    missing = [op for op in manifest.ops if not callable(getattr(module, op, None))]
    layers = getattr(module, "layers", None)
    missing += [f"layers.{name}" for name in manifest.layers if not hasattr(layers, name)]
    if missing:
        raise KernelHubError(
            f"kernel {manifest.name} {manifest.version} declares but does not export: "
            f"{', '.join(missing)}"
        )
