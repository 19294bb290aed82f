"""What the wheel carries and how builds made for other kernel APIs are treated.

The suite itself runs against the installed wheel (scripts/test.sh); these tests check the parts
a test of behaviour would not notice: builtin files present in the installed package, the sdist
giving the same wheel, and a hub build made before the kernel API refused with a clear message.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import kernel_hub
from kernel_hub.errors import RequirementError
from kernel_hub.loading.loader import load_kernel_dir, module_name_for
from kernel_hub.paths import kernels_dir, registry_path
from kernel_hub.registry.manifest import load_manifest
from kernel_hub.registry.registry import load_registry
from kernel_hub.version import KERNEL_API_VERSION

CHECKOUT = Path(__file__).resolve().parents[1]


def test_registry_and_kernels_ship_inside_the_package() -> None:
    package = Path(kernel_hub.__file__).resolve().parent
    installed = package != CHECKOUT / "kernel_hub"  # not an editable checkout
    home = package / "builtin" if installed else CHECKOUT
    assert registry_path().resolve() == home / "registry.yaml"
    for entry in load_registry().ops.values():
        kernel = kernels_dir() / entry.kernel
        assert (kernel / "kernel.yaml").is_file(), kernel
        assert not (installed and (kernel / "tests").exists()), f"{kernel}/tests was installed"


@pytest.mark.parametrize(
    ("requirement", "message"),
    [
        # kernel-hub 0.1 builds imported kernel_hub.bridge, .cases, ... directly and named no API
        ("", "needs a kernel API version"),
        # kernel API 1.0-1.2 builds exported module attributes, no KERNEL declaration
        ('kernel-hub: ">=1.2"', "needs kernel API kernel-hub>=1.2: a build for kernel API 1.0-1.2"),
    ],
    ids=["no-api", "api-1.2"],
)
def test_build_for_an_old_kernel_api_is_refused_before_import(
    tmp_path: Path, requirement: str, message: str
) -> None:
    kernel = shutil.copytree(kernels_dir() / "rmsnorm", tmp_path / "rmsnorm")
    manifest = kernel / "kernel.yaml"
    text = re.sub(r'kernel-hub: ">=[\d.]+".*', requirement, manifest.read_text())
    manifest.write_text(text)
    with pytest.raises(RequirementError) as info:
        load_kernel_dir(kernel)
    assert f"kernel rmsnorm {load_manifest(kernel).version} {message}" in str(info.value)
    assert f"provides kernel API {KERNEL_API_VERSION}" in str(info.value)
    assert module_name_for(load_manifest(kernel), kernel) not in sys.modules, "it was imported"


def test_build_asking_for_a_newer_kernel_api_is_refused(tmp_path: Path) -> None:
    kernel = shutil.copytree(kernels_dir() / "rmsnorm", tmp_path / "rmsnorm")
    manifest = kernel / "kernel.yaml"
    text = re.sub(r'kernel-hub: ">=[\d.]+"', 'kernel-hub: ">=2.0"', manifest.read_text())
    assert 'kernel-hub: ">=2.0"' in text
    manifest.write_text(text)
    with pytest.raises(
        RequirementError,
        match=r"kernel API kernel-hub>=2\.0 \(this kernel-hub "
        rf"[\d.]+ provides kernel API {KERNEL_API_VERSION}\)",
    ):
        load_kernel_dir(kernel)


def _wheel_files(wheel: Path) -> dict[str, str]:
    with zipfile.ZipFile(wheel) as archive:
        return {
            name: hashlib.sha256(archive.read(name)).hexdigest()
            for name in archive.namelist()
            if not name.endswith("RECORD")
        }


@pytest.mark.slow
@pytest.mark.skipif(not (CHECKOUT / "pyproject.toml").is_file(), reason="needs the source tree")
def test_sdist_builds_the_same_wheel(tmp_path: Path) -> None:
    # a copy, so the builds leave nothing (build/, *.egg-info) in the checkout
    source = shutil.copytree(
        CHECKOUT,
        tmp_path / "source",
        ignore=shutil.ignore_patterns(
            ".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__"
        ),
    )
    pip = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps"]
    subprocess.run([*pip, "--wheel-dir", tmp_path / "direct", source], check=True)
    subprocess.run(
        [sys.executable, "-m", "build", "--sdist", "--outdir", tmp_path / "sdist", source],
        check=True,
        capture_output=True,
    )
    (sdist,) = (tmp_path / "sdist").glob("*.tar.gz")
    subprocess.run([*pip, "--wheel-dir", tmp_path / "from-sdist", sdist], check=True)
    (direct,) = (tmp_path / "direct").glob("*.whl")
    (rebuilt,) = (tmp_path / "from-sdist").glob("*.whl")
    assert direct.name == rebuilt.name
    assert _wheel_files(direct) == _wheel_files(rebuilt)
    files = _wheel_files(direct)
    assert "kernel_hub/builtin/registry.yaml" in files
    shipped_kernels = {name.split("/")[3] for name in files if name.endswith("/kernel.yaml")}
    assert shipped_kernels == {p.parent.name for p in (CHECKOUT / "kernels").glob("*/kernel.yaml")}
    subpackages = {
        str(p.parent.relative_to(CHECKOUT)) for p in (CHECKOUT / "kernel_hub").rglob("__init__.py")
    }
    shipped_packages = {name.rsplit("/", 1)[0] for name in files if name.endswith("__init__.py")}
    assert subpackages <= shipped_packages, "a kernel_hub subpackage is missing from pyproject"
    assert not [name for name in files if "/tests/" in name], "kernel tests in the wheel"
    templates = CHECKOUT / "kernel_hub" / "cli" / "new_kernel_template"
    scaffold = {str(p.relative_to(CHECKOUT)) for p in templates.rglob("*.tmpl")}
    assert scaffold and scaffold <= set(files), "new-kernel's templates are missing from the wheel"
