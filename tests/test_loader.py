"""Loading kernel builds: isolation, identity, side-by-side versions, manifest errors, CLI list."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernel_hub import get_kernel
from kernel_hub.errors import KernelHubError, RequirementError, SourceError
from kernel_hub.loading.loader import load_kernel_dir
from kernel_hub.paths import kernels_dir
from kernel_hub.registry.manifest import parse_manifest


def copy_with_version(tmp_path, version: str):
    target = tmp_path / f"rmsnorm-{version}"
    shutil.copytree(
        kernels_dir() / "rmsnorm", target, ignore=shutil.ignore_patterns("tests", "__pycache__")
    )
    manifest = target / "kernel.yaml"
    text = re.sub(r"(?m)^version: .*$", f"version: {version}", manifest.read_text())
    manifest.write_text(text)
    return target


def test_get_kernel_exposes_ops_jax_layers_manifest():
    kernel = get_kernel("rmsnorm")
    assert callable(kernel.rms_norm) and callable(kernel.jax.rms_norm)
    assert kernel.layers.RMSNorm.has_backward
    assert kernel.manifest.name == "rmsnorm"
    assert get_kernel("rms-norm") is kernel, "loading twice must return the same module"


def test_two_versions_coexist(tmp_path):
    old = load_kernel_dir(copy_with_version(tmp_path, "1.0.1"))
    new = load_kernel_dir(copy_with_version(tmp_path, "1.1.0"))
    assert old is not new and old.__name__ != new.__name__
    assert str(old.manifest.version) == "1.0.1" and str(new.manifest.version) == "1.1.0"
    assert old.rms_norm.qualname != new.rms_norm.qualname
    x, w = torch.randn(4, 32), torch.randn(32)
    torch.testing.assert_close(old.rms_norm(x, w, 1e-6), new.rms_norm(x, w, 1e-6))


def test_registry_order_is_applied():
    kernel = get_kernel("rmsnorm")
    assert kernel.jax.TABLE.order("cpu") == ("xla", "pallas")


def test_failed_import_leaves_nothing_in_sys_modules(tmp_path):
    target = copy_with_version(tmp_path, "1.0.2")
    (target / "rmsnorm" / "layers.py").write_text("raise ImportError('broken build')\n")
    with pytest.raises(ImportError, match="broken build"):
        load_kernel_dir(target)
    assert not [name for name in sys.modules if "rmsnorm_1_0_2" in name]


def test_missing_export_is_reported(tmp_path):
    target = copy_with_version(tmp_path, "1.0.3")
    manifest = target / "kernel.yaml"
    manifest.write_text(
        manifest.read_text().replace("ops: [rms_norm, ", "ops: [rms_norm, fused_add, ")
    )
    with pytest.raises(
        KernelHubError, match=r"kernel\.yaml and the package's KERNEL disagree: ops fused_add in"
    ):
        load_kernel_dir(target)


def test_declared_layer_missing_from_the_manifest_is_reported(tmp_path):
    target = copy_with_version(tmp_path, "1.0.4")
    manifest = target / "kernel.yaml"
    manifest.write_text(manifest.read_text().replace("TorchRMSNorm, ", ""))
    with pytest.raises(KernelHubError, match="layers TorchRMSNorm declared, not in the manifest"):
        load_kernel_dir(target)
    assert not [name for name in sys.modules if "rmsnorm_1_0_4" in name]


def test_kernel_that_is_not_a_declaration_is_refused(tmp_path):
    target = copy_with_version(tmp_path, "1.0.5")
    init = target / "rmsnorm" / "__init__.py"
    init.write_text(init.read_text() + "\nKERNEL = {'ops': {}}\n")
    with pytest.raises(
        KernelHubError, match=r"KERNEL is a dict, not a kernel_api\.KernelDeclaration"
    ):
        load_kernel_dir(target)


API_1_2_BUILD = Path(__file__).parent / "fixtures" / "api-1.2-build"


def test_build_for_kernel_api_1_2_loads_through_the_legacy_declaration():
    """A kernel made for API 1.2 (module attributes, no KERNEL) still loads and computes."""
    kernel = load_kernel_dir(API_1_2_BUILD)
    declared = kernel.KERNEL
    assert set(declared.ops) == {"rms_norm"} and declared.jax is kernel.jax
    assert declared.layers["RMSNorm"] is kernel.layers.RMSNorm
    assert declared.module_checks == kernel.layers.MODULE_CHECKS
    assert [t.op for t in declared.implementation_tables] == ["rms_norm"]
    assert declared.benchmark_cases == tuple(kernel.benchmark.CASES)
    assert [c.name for c in declared.mesh_cases()]
    assert declared.integration("transformers") is None
    x, w = torch.randn(4, 32), torch.randn(32)
    expected = torch.nn.functional.rms_norm(x, (32,), w, 1e-6)
    torch.testing.assert_close(declared.ops["rms_norm"](x, w, 1e-6), expected)


def test_unmet_requirement_is_reported(tmp_path):
    target = copy_with_version(tmp_path, "1.0.4")
    manifest = target / "kernel.yaml"
    manifest.write_text(manifest.read_text().replace('jax: ">=0.7"', 'jax: ">=99"'))
    with pytest.raises(RequirementError, match=r"needs jax>=99 \(installed: "):
        load_kernel_dir(target)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            ("version: 1.1.0", "version: 1.0"),
            "kernel.yaml:2: manifest: field 'version': expected a semantic version",
        ),
        (("package: rmsnorm", "package: rms-norm"), "kernel.yaml:3: manifest: field 'package'"),
        (
            ("  xla: [tpu, gpu, cpu]", "  xla: [tpu, quantum]"),
            "kernel.yaml:10: manifest implementations: field 'xla': expected a list",
        ),
    ],
)
def test_malformed_manifest_names_line(edit, message):
    text = (kernels_dir() / "rmsnorm" / "kernel.yaml").read_text()
    with pytest.raises(SourceError) as info:
        parse_manifest("kernel.yaml", text.replace(*edit))
    assert message in str(info.value)


def test_cli_list_json_and_table():
    out = subprocess.run(
        [sys.executable, "-P", "-m", "kernel_hub.cli", "list", "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    rows = {row["op"]: row for row in json.loads(out.stdout)}
    assert rows["rmsnorm"]["would_run"] == "xla" and rows["rmsnorm"]["platform"] == "cpu"
    table = subprocess.run(
        [sys.executable, "-P", "-m", "kernel_hub.cli", "list"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "rmsnorm" in table and "RMSNorm" in table


def test_cli_reports_errors_without_traceback(tmp_path):
    bad = tmp_path / "registry.yaml"
    bad.write_text("schema: 1\nops:\n  x: 3\n")
    out = subprocess.run(
        [sys.executable, "-P", "-m", "kernel_hub.cli", "list", "--registry", str(bad)],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2
    assert f"{bad}:3: op 'x': expected a mapping, got int" in out.stderr
    assert "Traceback" not in out.stderr
