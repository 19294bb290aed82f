"""``kernel-hub new-kernel``: the scaffold passes its own tests, builds, compile-checks for a TPU
and loads through ``get_kernel``, as generated; names and registries are checked first."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernel_hub import get_kernel
from kernel_hub.cli import new_kernel
from kernel_hub.errors import KernelHubError, SourceError
from kernel_hub.paths import registry_path


def _cli(*args: str, env: dict[str, str] | None = None, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-P", "-m", "kernel_hub.cli", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        cwd=cwd,
    )


@pytest.mark.slow
@pytest.mark.tpu_compile
def test_new_kernel_tests_builds_compile_checks_and_loads(tmp_path):
    registry = tmp_path / "registry.yaml"
    registry.write_text(registry_path().read_text())
    made = _cli("new-kernel", "demo-op", "--dir", str(tmp_path), "--registry", str(registry))
    assert made.returncode == 0, made.stderr
    kernel_dir = tmp_path / "demo-op"
    env = {"KERNEL_HUB_REGISTRY": str(registry), "JAX_PLATFORMS": "cpu"}

    tests = subprocess.run(
        [sys.executable, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        cwd=kernel_dir,
    )
    assert tests.returncode == 0, tests.stdout[-3000:] + tests.stderr[-2000:]
    assert " passed" in tests.stdout and "failed" not in tests.stdout

    built = _cli("build", str(kernel_dir), "--json", env=env)
    assert built.returncode == 0, built.stderr
    assert (kernel_dir / "build" / "torch-cpu" / "demo_op" / "__init__.py").is_file()

    checked = _cli(
        "compile-check",
        "demo-op",
        "--tpu",
        "v5e",
        "--no-progress",
        env={**env, "KERNEL_HUB_LOCAL_KERNELS": f"demo-op={kernel_dir}"},
    )
    assert checked.returncode == 0, checked.stdout[-3000:] + checked.stderr[-2000:]
    assert "0 fail" in checked.stdout and " ok " in checked.stdout

    for source in (kernel_dir, kernel_dir / "build"):  # the kernel directory and its build
        kernel = get_kernel("demo_op", registry=registry, local_dir=source)
        x, weight = torch.randn(5, 256), torch.randn(256)
        torch.testing.assert_close(kernel.demo_op(x, weight), x * weight)
        assert set(kernel.KERNEL.ops) == {"demo_op"}


@pytest.mark.parametrize("name", ["Demo", "demo_op", "9demo", "demo-", ""])
def test_names_hub_builds_cannot_carry_are_refused(tmp_path, name):
    with pytest.raises(KernelHubError, match="lowercase letters, digits and '-'"):
        new_kernel.scaffold(name, tmp_path)
    assert not any(tmp_path.iterdir())


def test_an_existing_directory_is_never_overwritten(tmp_path):
    (tmp_path / "demo").mkdir()
    with pytest.raises(KernelHubError, match="already exists"):
        new_kernel.scaffold("demo", tmp_path)


def test_registry_left_unchanged_when_the_entry_would_not_parse(tmp_path):
    registry = tmp_path / "registry.yaml"
    original = registry_path().read_text().replace("ops:\n", "ops:\n  demo:\n    kernel: x\n", 1)
    registry.write_text(original)
    with pytest.raises(SourceError, match="duplicate key 'demo'"):
        new_kernel.add_to_registry(registry, "demo")
    assert registry.read_text() == original


def test_every_template_placeholder_is_known():
    """A ``$name`` the scaffold does not fill would fail only when someone runs it."""
    import string

    known = set(new_kernel.names("demo-op"))
    for template in new_kernel.TEMPLATE_DIR.rglob("*.tmpl"):
        found = {
            m.group("named") or m.group("braced")
            for m in string.Template.pattern.finditer(template.read_text())
            if m.group("named") or m.group("braced")
        }
        assert found <= known, f"{template.name}: {found - known}"


WRITING_A_KERNEL = Path(__file__).resolve().parents[1] / "docs" / "writing-a-kernel.md"


@pytest.mark.slow
@pytest.mark.skipif(not WRITING_A_KERNEL.is_file(), reason="needs the source tree")
def test_writing_a_kernel_snippets_run(capsys):
    """docs/writing-a-kernel.md's Python blocks, top to bottom, in one namespace."""
    blocks = re.findall(r"```python\n(.*?)```", WRITING_A_KERNEL.read_text(), re.S)
    assert len(blocks) >= 6
    namespace: dict = {}
    for number, block in enumerate(blocks, 1):
        exec(compile(block, f"writing-a-kernel.md block {number}", "exec"), namespace)
    printed = capsys.readouterr().out
    assert "has no implementation 'palas'; valid on cpu: pallas, xla" in printed
    assert "the JAX function's first parameters are (weight, x)" in printed
