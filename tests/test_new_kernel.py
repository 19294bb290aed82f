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
from kernel_hub.cli import from_jax, main, new_kernel
from kernel_hub.errors import KernelHubError, SourceError
from kernel_hub.paths import BUILTIN_DIR, registry_path


def _user_env() -> dict[str, str]:
    """This process's environment without kernel-hub's variables: what a user has."""
    return {k: v for k, v in os.environ.items() if not k.startswith("KERNEL_HUB_")}


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return _run([sys.executable, "-P", "-m", "kernel_hub.cli", *args], cwd)


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, env=_user_env(), cwd=cwd)


def run_printed_steps(steps: list[str], cwd: Path, tmp_path: Path) -> str:
    """The printed steps run verbatim, in order, in one bash shell (``&`` and inline variables as
    typed), ``python`` and ``kernel-hub`` being this interpreter and this kernel-hub; a fresh
    Hugging Face cache; the background jobs (``kernel-hub serve``) ended when the shell exits.
    Their output; a failed step fails the test with it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for program, argv in (("python", "-P"), ("kernel-hub", "-P -m kernel_hub.cli")):
        (bin_dir / program).write_text(f'#!/bin/sh\nexec {sys.executable} {argv} "$@"\n')
        (bin_dir / program).chmod(0o755)
    script = "set -e\ntrap 'kill $(jobs -p) 2>/dev/null || true' EXIT\n" + "\n".join(steps)
    env = {
        **_user_env(),
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "HF_HUB_CACHE": str(tmp_path / "hf-cache"),
        "XDG_STATE_HOME": str(tmp_path / "state"),  # what the client learns of signed indexes
        "HF_HUB_OFFLINE": "0",
        "HF_HUB_DISABLE_TELEMETRY": "1",
    }
    done = subprocess.run(
        ["bash", "-c", script], capture_output=True, text=True, env=env, cwd=cwd, timeout=1500
    )
    assert done.returncode == 0, f"{done.stdout[-4000:]}{done.stderr[-3000:]}"
    return done.stdout


@pytest.mark.slow
@pytest.mark.tpu_compile
def test_new_kernel_in_an_empty_directory_runs_its_printed_next_steps(tmp_path, monkeypatch):
    """As a user would: an empty directory outside the checkout, no kernel-hub variables, the
    printed steps run verbatim: tests, build, compile-check, publish to a local ``kernel-hub
    serve`` and ``get_kernel`` by version."""
    project = tmp_path / "project"
    project.mkdir()
    made = _cli("new-kernel", "demo-op", cwd=project)
    assert made.returncode == 0, made.stderr
    steps = [line.strip() for line in made.stdout.splitlines() if line.startswith("  ")]
    assert steps == new_kernel.next_steps("demo-op", Path("kernels/demo-op"), "registry.yaml")
    out = run_printed_steps(steps, project, tmp_path)
    assert " passed" in out and " failed" not in out
    assert "0 fail" in out and " ok " in out  # compile-check
    assert "hub kernel-hub/demo-op 1.0.0" in out, out[-3000:]  # loaded from the local hub

    kernel_dir = project / "kernels" / "demo-op"
    for key in [k for k in os.environ if k.startswith("KERNEL_HUB_")]:
        monkeypatch.delenv(key)
    monkeypatch.chdir(project)  # the project's registry is the default here
    for local_dir in (None, kernel_dir / "build"):  # the project's kernel, then its build
        kernel = get_kernel("demo-op", local_dir=local_dir)
        assert kernel.origin.source == ("in-tree" if local_dir is None else "local")
        assert kernel.origin.path.is_relative_to(kernel_dir)
        x, weight = torch.randn(5, 256), torch.randn(256)
        torch.testing.assert_close(kernel.demo_op(x, weight), x * weight)
        assert set(kernel.KERNEL.ops) == {"demo_op"}


@pytest.mark.parametrize("name", ["Demo", "demo_op", "9demo", "demo-", ""])
def test_names_hub_builds_cannot_carry_are_refused(tmp_path, name):
    with pytest.raises(KernelHubError, match="lowercase letters, digits and '-'"):
        new_kernel.scaffold(name, tmp_path / "registry.yaml")
    assert not any(tmp_path.iterdir())


def test_an_existing_directory_is_never_overwritten_and_the_registry_not_touched(tmp_path):
    (tmp_path / "kernels" / "demo").mkdir(parents=True)
    with pytest.raises(KernelHubError, match="already exists"):
        new_kernel.scaffold("demo", tmp_path / "registry.yaml")
    assert not (tmp_path / "registry.yaml").exists()


def test_a_registry_in_a_missing_directory_is_refused_before_writing(tmp_path):
    with pytest.raises(KernelHubError, match=r"directory .*missing does not exist"):
        new_kernel.scaffold("demo", tmp_path / "missing" / "registry.yaml")
    assert not any(tmp_path.iterdir())


def test_registry_left_unchanged_when_the_entry_would_not_parse(tmp_path):
    registry = tmp_path / "registry.yaml"
    original = registry_path().read_text().replace("ops:\n", "ops:\n  demo:\n    kernel: x\n", 1)
    registry.write_text(original)
    with pytest.raises(SourceError, match="duplicate key 'demo'"):
        new_kernel.scaffold("demo", registry)
    assert registry.read_text() == original
    assert sorted(p.name for p in tmp_path.iterdir()) == ["registry.yaml"]


@pytest.mark.parametrize("existed", [True, False], ids=["registry-existed", "registry-created"])
def test_a_failed_write_leaves_the_project_as_found(tmp_path, monkeypatch, existed):
    registry = tmp_path / "registry.yaml"
    if existed:
        registry.write_text(registry_path().read_text())
    # a file where the next one needs a directory: the second write fails
    monkeypatch.setattr(new_kernel, "render", lambda kernel: {Path("a"): "", Path("a/b"): ""})
    with pytest.raises(OSError):
        new_kernel.scaffold("demo", registry)
    if existed:
        assert registry.read_text() == registry_path().read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == (["registry.yaml"] if existed else [])


def test_the_current_directory_is_a_project_with_a_registry_and_kernels(tmp_path, monkeypatch):
    monkeypatch.delenv("KERNEL_HUB_REGISTRY", raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "registry.yaml").write_text("schema: 1\nops: {}\n")
    assert registry_path() == BUILTIN_DIR / "registry.yaml"
    (tmp_path / "kernels").mkdir()
    assert registry_path() == tmp_path / "registry.yaml"
    (tmp_path / "kernel_hub").mkdir()  # kernel-hub's own source tree is not a kernel project
    assert registry_path() == BUILTIN_DIR / "registry.yaml"


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
    assert "x0 x1, y0 y1 -> x0 x1" in printed  # --from-jax's rule: the example's dimensions


USER_MODULE = '''
def scale_add(x, y, *, alpha: float = 1.0, out_sharding=None):
    """x * alpha + y."""
    return x * alpha + y


def needs_square(x):
    return x @ x


def variadic(x, *rest):
    return x


def shadowing(x, *, jax: bool = True):
    return x
'''


@pytest.mark.slow
def test_from_jax_wraps_a_users_function_whose_generated_tests_pass(tmp_path):
    """As a user would: a module of theirs on PYTHONPATH, an empty directory, the printed test
    step run verbatim; then the op runs from the project with no kernel-hub variables."""
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "mymod.py").write_text(USER_MODULE)
    project = tmp_path / "project"
    project.mkdir()
    path = [str(tmp_path / "mine"), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**_user_env(), "PYTHONPATH": os.pathsep.join(path)}
    wrap = ["--from-jax", "mymod:scale_add", "--example-shapes", "x=5,200 y=5,200"]
    made = subprocess.run(
        [sys.executable, "-P", "-m", "kernel_hub.cli", "new-kernel", "scale-add", *wrap],
        capture_output=True,
        text=True,
        env=env,
        cwd=project,
    )
    assert made.returncode == 0, made.stderr
    assert "  python -m pytest kernels/scale-add/tests" in made.stdout.splitlines()
    tested = subprocess.run(
        [sys.executable, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider", "kernels/"],
        capture_output=True,
        text=True,
        env=env,
        cwd=project,
    )
    assert tested.returncode == 0, tested.stdout[-3000:]
    assert "6 passed" in tested.stdout
    api = (project / "kernels/scale-add/scale_add/api.py").read_text()
    assert "from mymod import scale_add as wrapped" in api
    assert "Left at the function's default (None): out_sharding." in api
    assert '"x0 x1, y0 y1 -> x0 x1"' in api
    manifest = (project / "kernels/scale-add/kernel.yaml").read_text()
    assert "mymod comes from no installed distribution" in manifest


def test_from_jax_reads_a_library_function_and_records_its_distribution():
    wrapped = from_jax.inspect_function("jax.nn:gelu")
    assert wrapped.arrays == ("x",) and wrapped.result_shape == (8, 128)
    assert wrapped.options == (from_jax.Option("approximate", "bool", True),)
    assert wrapped.grad_problem is None and wrapped.requirement[0] == "jax"
    files = from_jax.render(new_kernel.names("gelu"), wrapped)
    assert 'jax: ">=' in files[Path("kernel.yaml")]
    assert "approximate: bool = True," in files[Path("gelu/api.py")]  # also the torch schema
    assert Path("gelu/torch_ops.py") not in files


def test_from_jax_keeps_a_mosaic_kernel_to_the_platforms_it_lowers_for():
    """JAX's own Pallas TPU flash attention: TPU only, its tests skipped on the CPU with why."""
    spec = "jax.experimental.pallas.ops.tpu.flash_attention:flash_attention"
    wrapped = from_jax.inspect_function(spec, "q=1,2,128,128 k=1,2,128,128 v=1,2,128,128")
    assert wrapped.arrays == ("q", "k", "v") and wrapped.platforms == ("tpu",)
    assert "interpret mode" in wrapped.lowering_problems["cpu"]
    assert {"ab", "segment_ids", "block_sizes"} <= set(wrapped.left_at_default)
    files = from_jax.render(new_kernel.names("flash"), wrapped)
    assert "pytest.mark.skipif(" in files[Path("tests/test_flash.py")]
    assert "  jax: [tpu]" in files[Path("kernel.yaml")]


@pytest.mark.parametrize(
    ("spec", "shapes", "message"),
    [
        ("mymod", None, "expected module:function"),
        ("nosuchmodule_xyz:f", None, "does not import here"),
        ("mymod:missing", None, "mymod has no function 'missing'"),
        ("mymod:variadic", None, r"\*rest \(variadic\)"),
        ("mymod:shadowing", None, "parameter 'jax' is a name the generated kernel uses"),
        ("mymod:needs_square", "x=8,4", "calling it on float32 arrays x=8,4 failed"),
        ("mymod:scale_add", "x=8,128", r"names \['x'\] but .* are \['x', 'y'\]"),
        ("mymod:scale_add", "x=8,0 y=8", "is not NAME=D,D"),
    ],
)
def test_from_jax_refuses_what_it_cannot_wrap_before_writing(
    tmp_path, monkeypatch, capsys, spec, shapes, message
):
    (tmp_path / "mymod.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "mymod", raising=False)
    monkeypatch.chdir(tmp_path)
    argv = ["new-kernel", "demo", "--from-jax", spec]
    assert main(argv + (["--example-shapes", shapes] if shapes else [])) == 2
    assert re.search(message, capsys.readouterr().err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mymod.py"]
