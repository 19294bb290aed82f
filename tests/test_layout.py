"""The package's import graph: layers by concern, no upward import, no cycle; kernels see only
``kernel_hub.kernel_api``.

Every ``import`` counts, also those inside functions (a lazy import is still a dependency); only
imports under ``if TYPE_CHECKING:`` are skipped, since they never run.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import kernel_hub
from kernel_hub.paths import kernels_dir

PACKAGE = Path(kernel_hub.__file__).resolve().parent

# Component -> rank. A module may import its own component or one of lower rank.
RANKS = {
    "version": 0,
    "errors": 0,
    "platform": 1,
    "paths": 1,
    "user_cache": 1,
    "progress": 1,
    "checks": 1,
    "tpu_tiling": 1,
    "options": 1,
    "weight_formats": 1,
    "transformers_ep": 1,
    "dispatch": 2,
    "declaration": 3,
    "topologies": 2,
    "registry": 3,
    "sharding": 3,
    "hub": 4,
    "bridge": 4,
    "loading": 5,
    "bench": 6,
    "kernel_api": 7,
    "layers": 7,
    "testing": 7,
    "models": 8,
    "cli": 9,
    "__init__": 10,
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(path: Path, module: str, root: str = "kernel_hub") -> set[str]:
    """Absolute names of the modules (or packages) under ``root`` that ``path`` imports."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == root)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            if target.split(".")[0] == root:
                found.add(target)
                found.update(f"{target}.{a.name}" for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return found


def _graph() -> dict[str, set[str]]:
    files = {
        _module_name(p): p
        for p in PACKAGE.rglob("*.py")
        if "builtin" not in p.relative_to(PACKAGE).parts
    }
    return {
        name: {m for m in _imports(path, name) if m in files and m != name}
        for name, path in files.items()
    }


def _component(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_component_has_a_rank() -> None:
    assert {_component(m) for m in _graph()} <= set(RANKS), "give new components a rank"


def test_no_upward_imports() -> None:
    upward = [
        f"{module} -> {target}"
        for module, targets in _graph().items()
        for target in targets
        if _component(target) != _component(module)
        and RANKS[_component(target)] >= RANKS[_component(module)]
    ]
    assert not upward, "imports against the layer order:\n" + "\n".join(sorted(upward))


def _cycles(graph: dict[str, set[str]]) -> list[str]:
    """Each import cycle of ``graph`` (module -> the modules it imports), as ``a -> b -> a``."""
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def walk(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if node.startswith(nxt + "."):  # importing a submodule runs its parent package first
                continue
            if state.get(nxt) == 1:
                cycles.append([*stack[stack.index(nxt) :], nxt] if nxt in stack else [node, nxt])
            elif nxt not in state:
                walk(nxt, [*stack, nxt])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            walk(module, [module])
    return [" -> ".join(cycle) for cycle in cycles]


def test_no_import_cycles() -> None:
    cycles = _cycles(_graph())
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def _package_graph(package_dir: Path) -> dict[str, set[str]]:
    """The import graph inside one kernel package (its modules by dotted name)."""
    files = {}
    for path in package_dir.rglob("*.py"):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return {
        name: {m for m in _imports(path, name, root=package_dir.name) if m in files and m != name}
        for name, path in files.items()
    }


def _kernel_packages() -> list[Path]:
    return sorted(
        p.parent for p in kernels_dir().glob("*/*/__init__.py") if p.parent.name != "tests"
    )


@pytest.mark.parametrize("package", _kernel_packages(), ids=lambda p: p.parent.name)
def test_no_import_cycles_inside_a_kernel_package(package: Path) -> None:
    """A kernel's modules import in one direction (math <- api <- ops, cases); test data such as
    mesh and benchmark cases sits on top, never imported back."""
    cycles = _cycles(_package_graph(package))
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_scaffold_has_no_import_cycles(tmp_path: Path) -> None:
    from kernel_hub.cli import new_kernel

    for relative, text in new_kernel.render("demo-op").items():
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text(text)
    cycles = _cycles(_package_graph(tmp_path / "demo_op"))
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def _kernel_package_files() -> list[Path]:
    return sorted(
        p
        for p in kernels_dir().glob("*/*/**/*.py")
        if p.relative_to(kernels_dir()).parts[1] != "tests"
    )


def test_kernels_import_only_the_kernel_api() -> None:
    files = _kernel_package_files()
    assert files, f"no kernel packages under {kernels_dir()}"
    offending = []
    for path in files:
        for target in _imports(path, "kernel.package"):
            if target != "kernel_hub" and not target.startswith("kernel_hub.kernel_api"):
                offending.append(f"{path.relative_to(kernels_dir())}: {target}")
            elif target == "kernel_hub":
                offending.append(f"{path.relative_to(kernels_dir())}: kernel_hub (use kernel_api)")
    assert not offending, "kernels may import only kernel_hub.kernel_api:\n" + "\n".join(offending)


@pytest.mark.parametrize(
    "kernel", sorted(p.parent.name for p in kernels_dir().glob("*/kernel.yaml"))
)
def test_kernel_manifests_declare_the_kernel_api(kernel: str) -> None:
    from kernel_hub.registry.manifest import load_manifest
    from kernel_hub.version import KERNEL_API_REQUIREMENT

    assert KERNEL_API_REQUIREMENT in load_manifest(kernels_dir() / kernel).requires


CHECKOUT_KERNELS = Path(__file__).resolve().parents[1] / "kernels"


@pytest.mark.skipif(not CHECKOUT_KERNELS.is_dir(), reason="kernel tests live in the checkout")
def test_every_registry_kernel_brings_tests_and_compile_cells() -> None:
    """CI finds a kernel's tests (``kernels/<name>/tests``) and compile cells (its declaration's
    benchmark cases) from the registry: a kernel without either would go untested."""
    from kernel_hub import get_kernel, load_registry

    missing = []
    for entry in load_registry():
        if not list((CHECKOUT_KERNELS / entry.kernel / "tests").glob("test_*.py")):
            missing.append(f"{entry.kernel}: no kernels/{entry.kernel}/tests/test_*.py")
        if not get_kernel(entry.name).KERNEL.benchmark_cases:
            missing.append(f"{entry.kernel}: KERNEL declares no benchmark_cases")
    assert not missing, "\n".join(missing)


def _contract_names() -> set[str]:
    """What kernel-hub reads from a kernel or its adapters: the declaration's and adapter's
    fields."""
    from dataclasses import fields

    from kernel_hub.declaration import LAYER_FLAGS, FrameworkAdapter, KernelDeclaration

    declared = {f.name for cls in (KernelDeclaration, FrameworkAdapter) for f in fields(cls)}
    # a model's ``layers`` is read with a default in places, a kernel's never
    return (declared - {"layers"}) | set(LAYER_FLAGS) | {"KERNEL"}


def test_kernel_contract_is_read_without_defaults() -> None:
    """``getattr(x, "<contract name>", default)`` hides a kernel or adapter that does not state
    what it must (the declaration and ``FrameworkAdapter.of`` read without defaults)."""
    names = _contract_names()
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).parts[0] == "builtin":
            continue  # the wheel's copy of kernels/: kernels read their own inputs (torchax .jax)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "getattr"
                and len(node.args) == 3
                and isinstance(node.args[1], ast.Constant)
                and node.args[1].value in names
            ):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "contract attributes read with a default:\n" + "\n".join(found)
