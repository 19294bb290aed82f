"""Loading kernel builds: isolation, identity, side-by-side versions, manifest errors, CLI list."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from kernel_hub import get_kernel
from kernel_hub.declaration import FrameworkAdapter, KernelDeclaration
from kernel_hub.errors import KernelHubError, RequirementError, SourceError
from kernel_hub.loading.loader import load_kernel_dir
from kernel_hub.paths import kernels_dir, registry_path
from kernel_hub.registry.manifest import parse_manifest
from kernel_hub.registry.registry import load_registry


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


def test_without_a_registry_order_the_kernels_own_applies(tmp_path):
    """The registry's ``implementations`` is an optional override: without it ``get_kernel`` and
    ``kernel-hub list`` use the order the kernel's tables state."""
    from kernel_hub.cli.registry_cmds import list_ops

    registry = tmp_path / "registry.yaml"
    text = Path(registry_path()).read_text()
    stated = "".join(
        f"{line}\n"
        for line in (
            "    implementations:",
            "      tpu: [pallas, xla]",
            "      gpu: [xla]",
            "      cpu: [xla, pallas]",
        )
    )
    head, _, rest = text.partition("  rmsnorm:\n")
    assert stated in rest
    registry.write_text(head + "  rmsnorm:\n" + rest.replace(stated, "", 1))
    assert not load_registry(registry).get("rmsnorm").overrides_order
    assert get_kernel("rmsnorm", registry=registry).jax.TABLE.order("cpu") == ("xla", "pallas")
    row = next(row for row in list_ops(str(registry)) if row["op"] == "rmsnorm")
    assert row["implementations"] == ["xla", "pallas"] and row["would_run"] == "xla"


def test_failed_import_leaves_nothing_in_sys_modules(tmp_path):
    target = copy_with_version(tmp_path, "1.0.2")
    (target / "rmsnorm" / "layers.py").write_text("raise ImportError('broken build')\n")
    with pytest.raises(ImportError, match="broken build"):
        load_kernel_dir(target)
    assert not [name for name in sys.modules if "rmsnorm_1_0_2" in name]


def test_missing_export_is_reported_at_the_manifest_line(tmp_path):
    target = copy_with_version(tmp_path, "1.0.3")
    manifest = target / "kernel.yaml"
    manifest.write_text(
        manifest.read_text().replace("ops: [rms_norm, ", "ops: [rms_norm, fused_add, ")
    )
    with pytest.raises(SourceError) as info:
        load_kernel_dir(target)
    assert (info.value.path, info.value.line) == (str(manifest), 6)
    assert (
        "the manifest and the package's KERNEL disagree: ops fused_add in the manifest, not "
        "declared" in str(info.value)
    )


def test_declared_layer_missing_from_the_manifest_is_reported(tmp_path):
    target = copy_with_version(tmp_path, "1.0.4")
    manifest = target / "kernel.yaml"
    manifest.write_text(manifest.read_text().replace("TorchRMSNorm, ", ""))
    with pytest.raises(
        SourceError, match=r"kernel\.yaml:7: .*layers TorchRMSNorm declared, not in the manifest"
    ):
        load_kernel_dir(target)
    assert not [name for name in sys.modules if "rmsnorm_1_0_4" in name]


def test_implementation_the_package_lacks_is_reported_at_the_manifest_line(tmp_path):
    target = copy_with_version(tmp_path, "1.0.6")
    manifest = target / "kernel.yaml"
    text = manifest.read_text().replace(
        "  xla: [tpu, gpu, cpu]", "  xla: [tpu, gpu, cpu]\n  mosaic: [tpu]"
    )
    manifest.write_text(text)
    with pytest.raises(
        SourceError,
        match=r"kernel\.yaml:11: .*implementations mosaic in the manifest, not decl",
    ):
        load_kernel_dir(target)


REGISTRY_EDITS = [
    (
        (
            "      cpu: [xla, pallas]\n    layers: [RMSNorm,",
            "      cpu: [palas, xla]\n    layers: [RMSNorm,",
        ),
        "implementations.cpu",
        "op 'rmsnorm': kernel rmsnorm 1.3.0 has no implementation 'palas'; "
        "valid on cpu: pallas, xla",
    ),
    (
        (
            "      gpu: [xla]\n      cpu: [xla, pallas]\n    layers: [RMSNorm,",
            "      gpu: [pallas, xla]\n      cpu: [xla, pallas]\n    layers: [RMSNorm,",
        ),
        "implementations.gpu",
        "implementation 'pallas' does not run on gpu (only tpu, cpu); valid on gpu: xla",
    ),
    (
        ("layers: [RMSNorm, RMSNormF32Scale", "layers: [RMSNorm, RMSNormF32", 1),
        "layers",
        "op 'rmsnorm': kernel rmsnorm 1.3.0 has no layer 'RMSNormF32'; its layers: RMSNorm, ",
    ),
]


@pytest.mark.parametrize(("edit", "field", "message"), REGISTRY_EDITS)
def test_registry_entry_checked_against_the_kernel_at_load_time(tmp_path, edit, field, message):
    """A registry naming an implementation, platform or layer the kernel lacks is refused at the
    registry's line with the valid names (a typo used to drop the implementation silently)."""
    registry = tmp_path / "registry.yaml"
    text = Path(registry_path()).read_text()
    assert edit[0] in text
    registry.write_text(text.replace(*edit))
    entry = load_registry(registry).get("rmsnorm")
    with pytest.raises(SourceError) as info:
        get_kernel("rmsnorm", registry=registry)
    assert (info.value.path, info.value.line) == (str(registry), entry.lines[field])
    assert message in str(info.value)


def test_unknown_platform_in_the_registry_names_line_and_valid_platforms(tmp_path):
    registry = tmp_path / "registry.yaml"
    text = Path(registry_path()).read_text()
    registry.write_text(
        text.replace("      gpu: [xla]\n", "      gpu: [xla]\n      npu: [xla]\n", 1)
    )
    with pytest.raises(
        SourceError, match=r"registry\.yaml:26: .*unknown field 'npu'; valid fields: cpu, gpu, tpu"
    ):
        get_kernel("rmsnorm", registry=registry)


def test_kernel_that_is_not_a_declaration_is_refused(tmp_path):
    target = copy_with_version(tmp_path, "1.0.5")
    init = target / "rmsnorm" / "__init__.py"
    init.write_text(init.read_text() + "\nKERNEL = {'ops': {}}\n")
    with pytest.raises(
        KernelHubError, match=r"KERNEL is a dict, not a kernel_api\.KernelDeclaration"
    ):
        load_kernel_dir(target)


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
            (r"^version: .*$", "version: 1.0"),
            "kernel.yaml:2: manifest: field 'version': expected a semantic version",
        ),
        ((r"^package: rmsnorm$", "package: rms-norm"), "kernel.yaml:3: manifest: field 'package'"),
        (
            (r"^  xla: \[tpu, gpu, cpu\]$", "  xla: [tpu, quantum]"),
            "kernel.yaml:10: manifest implementations: field 'xla': expected a list",
        ),
    ],
)
def test_malformed_manifest_names_line(edit, message):
    text = (kernels_dir() / "rmsnorm" / "kernel.yaml").read_text()
    # a pattern that stops matching the manifest must fail here, not pass as a no-op
    edited, count = re.subn(*edit, text, flags=re.MULTILINE)
    assert count == 1, f"{edit[0]!r} no longer matches rmsnorm's kernel.yaml"
    with pytest.raises(SourceError) as info:
        parse_manifest("kernel.yaml", edited)
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


def test_every_in_tree_framework_adapter_states_the_whole_contract():
    for entry in load_registry():
        declared = get_kernel(entry.name).KERNEL
        for slot in declared.integrations:
            adapter = declared.adapter(slot, entry.name)
            assert callable(adapter.register) and isinstance(adapter.has_backward, bool)


def test_adapter_missing_an_attribute_is_refused_naming_it():
    partial = types.SimpleNamespace(register=lambda: "name", has_backward=True)
    with pytest.raises(KernelHubError, match="k adapter lacks can_torch_compile, module_problem"):
        FrameworkAdapter.of(partial, "k adapter")
    wrong = types.SimpleNamespace(
        register="name", has_backward=1, can_torch_compile=True, module_problem=None
    )
    with pytest.raises(
        KernelHubError, match="has_backward is not a bool; register is not callable"
    ):
        FrameworkAdapter.of(wrong, "k adapter")


def test_declared_layer_must_state_its_mode_flags():
    class Layer(torch.nn.Module):
        has_backward = True

    with pytest.raises(
        KernelHubError, match=r"layers\['L'\] lacks the class attribute can_torch_compile"
    ):
        KernelDeclaration(ops={}, jax=None, layers={"L": Layer})
