"""``kernel-hub new-kernel NAME``: a new kernel directory from the scaffold.

The scaffold is a complete kernel (manifest; package with reference, Pallas TPU kernel, JAX API
and implementation table, torch op, sharding rule, benchmark cases, ``KERNEL`` declaration; tests)
computing ``x * weight``: it passes its own tests, builds, compile-checks and loads as generated,
so a kernel author replaces the computation and keeps a working kernel at every step. It is
written into a kernel project: ``kernels/NAME`` beside the registry (``./registry.yaml``, created
from the built-in one if missing), whose entry for the op it adds, so the tests, ``compile-check``
and ``get_kernel`` find it from that directory with no environment variables.
docs/writing-a-kernel.md walks through it. The templates ship in the wheel
(``new_kernel_template/``, ``string.Template`` placeholders).
"""

from __future__ import annotations

import argparse
import shutil
import string
import tempfile
from pathlib import Path

from kernel_hub.cli import from_jax
from kernel_hub.errors import KernelHubError
from kernel_hub.hub.metadata import KERNEL_NAME
from kernel_hub.paths import BUILTIN_DIR, KERNELS_NAME, REGISTRY_NAME
from kernel_hub.registry.registry import parse_registry

TEMPLATE_DIR = Path(__file__).parent / "new_kernel_template"
TEMPLATE_SUFFIX = ".tmpl"
SCAFFOLD_SUMMARY = "x * weight along the last axis (the kernel-hub scaffold, to be replaced)"
RENAMED = {
    "package": "{package}",
    "kernel_tests": "tests",  # not "tests/" in the wheel, where only kernel tests would be
    "test_kernel.py.tmpl": "test_{package}.py.tmpl",
}


def names(kernel: str, summary: str = SCAFFOLD_SUMMARY) -> dict[str, str]:
    """The template's placeholders for kernel ``kernel``: its package (and op) name is the
    kernel name with '-' as '_', as ``kernel-hub build`` requires."""
    if not KERNEL_NAME.match(kernel):
        raise KernelHubError(
            f"kernel name {kernel!r}: use lowercase letters, digits and '-', starting with a letter"
        )
    package = kernel.replace("-", "_")
    return {
        "kernel": kernel,
        "package": package,
        "op": package,
        "summary": summary,
    }


def render(kernel: str) -> dict[Path, str]:
    """The scaffold's files for kernel ``kernel``: path inside the kernel directory -> text."""
    values = names(kernel)
    files = sorted(TEMPLATE_DIR.rglob(f"*{TEMPLATE_SUFFIX}"))
    if not files:
        raise KernelHubError(f"no scaffold templates under {TEMPLATE_DIR} (a broken install?)")
    rendered = {}
    for template in files:
        relative = template.relative_to(TEMPLATE_DIR)
        parts = [RENAMED.get(part, part).format(**values) for part in relative.parts]
        parts[-1] = parts[-1].removesuffix(TEMPLATE_SUFFIX)
        rendered[Path(*parts)] = string.Template(template.read_text()).substitute(values)
    return rendered


def scaffold(
    kernel: str,
    registry: str | Path = REGISTRY_NAME,
    wrapped: from_jax.WrappedFunction | None = None,
) -> Path:
    """Write kernel ``kernel`` into ``kernels/`` beside ``registry`` and add its op to the
    registry (created from the built-in one if missing); its path. With ``wrapped`` (see
    ``from_jax.inspect_function``) the kernel wraps that JAX function instead of being the
    scaffold.

    Everything is checked before anything is written (name, free directory, the registry with the
    new entry parses); if writing fails, the registry and the kernels folder are left as found.
    """
    registry = Path(registry)
    target = registry.parent / KERNELS_NAME / kernel
    if wrapped is None:
        files, values = render(kernel), names(kernel)
    else:
        values = names(kernel, f"{wrapped.spec} as a kernel-hub op")
        files = from_jax.render(values, wrapped)
    if target.exists():
        raise KernelHubError(f"{target} already exists; choose another name")
    if not registry.parent.is_dir():
        raise KernelHubError(
            f"--registry {registry}: directory {registry.parent} does not exist; "
            "create it or name a registry in an existing directory"
        )
    original = _read(registry) if registry.exists() else None
    entry = registry_entry(values)
    updated = registry_with(registry, original or _read(BUILTIN_DIR / REGISTRY_NAME), entry)
    made_kernels_dir = not target.parent.exists()
    try:
        _write_atomically(registry, updated)
        target.parent.mkdir(exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{kernel}.", dir=target.parent))
        try:
            for relative, text in files.items():
                (staging / relative).parent.mkdir(parents=True, exist_ok=True)
                (staging / relative).write_text(text)
            staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    except BaseException:
        if original is None:
            registry.unlink(missing_ok=True)
        else:
            _write_atomically(registry, original)
        if made_kernels_dir:
            shutil.rmtree(target.parent, ignore_errors=True)
        raise
    return target


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError as exc:
        raise KernelHubError(f"cannot read {path}: {exc.strerror or exc}") from None


def _write_atomically(path: Path, text: str) -> None:
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text)
    partial.replace(path)


def registry_entry(values: dict[str, str]) -> str:
    """The ``registry.yaml`` entry (under ``ops:``) that makes the kernel's op loadable; the
    implementation order is the kernel's own (its table), which an ``implementations`` entry
    could override per platform."""
    kernel = values["kernel"]
    aliases = f"    aliases: [{values['op']}]\n" if values["op"] != kernel else ""
    return (
        f"  {kernel}:\n"
        f"    summary: {values['summary']}\n"
        f"{aliases}"
        f"    kernel: {kernel}\n"
        f"    repo: kernel-hub/{kernel}\n"
        f'    version: ">=1.0,<2"\n'
    )


def registry_with(path: Path, text: str, entry: str) -> str:
    """Registry ``text`` (of file ``path``) with ``entry`` appended to its ``ops:`` mapping,
    which must come last; a result that would not parse raises (the error says why)."""
    updated = text + ("" if text.endswith("\n") else "\n") + entry
    parse_registry(path, updated)
    return updated


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "new-kernel",
        help="scaffold a new kernel directory",
        description=__doc__.split("\n\n")[1],
    )
    parser.add_argument("name", help="kernel name: lowercase letters, digits and '-'")
    parser.add_argument(
        "--registry",
        default=REGISTRY_NAME,
        help="the project's registry: the op's entry is added to it (created from the built-in "
        "registry if missing) and the kernel written to kernels/ beside it (default: "
        "./registry.yaml)",
    )
    parser.add_argument(
        "--from-jax",
        metavar="MODULE:FUNCTION",
        help="wrap this JAX or Pallas function (importable here and wherever the kernel loads) "
        "as the kernel's op instead of writing the x * weight scaffold",
    )
    parser.add_argument(
        "--example-shapes",
        metavar="NAME=D,D,...",
        help="with --from-jax: float32 example shapes of the function's array parameters, "
        "space-separated (default: 8,128 each); the op is generated, and tested, for their ranks",
    )
    parser.set_defaults(func=run_new_kernel)


def run_new_kernel(args: argparse.Namespace) -> int:
    registry = Path(args.registry)
    existed = registry.exists()
    if args.example_shapes and not args.from_jax:
        raise KernelHubError("--example-shapes describes the function --from-jax names; add it")
    wrapped = (
        from_jax.inspect_function(args.from_jax, args.example_shapes) if args.from_jax else None
    )
    path = scaffold(args.name, registry, wrapped)
    project = registry.parent
    how = "added its op to" if existed else "created from the built-in registry, with its op,"
    print(f"created {path}; {how} {registry}")
    go = "" if project.resolve() == Path.cwd().resolve() else f"  cd {project}\n"
    kernel = path.relative_to(project)
    print(
        f"\nnext (from {project}, the kernel project; see docs/writing-a-kernel.md):\n{go}"
        + "".join(f"  {step}\n" for step in next_steps(args.name, kernel, registry.name)),
        end="",
    )
    return 0


LOCAL_HUB_PORT = 8765
"""The port the printed steps serve a local hub store on (``kernel-hub serve``)."""


def next_steps(name: str, kernel: Path, registry: str) -> list[str]:
    """The shell commands ``new-kernel`` prints: test, build and compile-check the kernel, then
    publish a signed build to a local ``kernel-hub serve`` store (its write token inline, the
    signing key pinned in ``registry``) and load it by version as ``get_kernel`` does."""
    token = "local-hub-write-token"  # the local store's; a real hub takes HF_TOKEN
    hub = f"HF_ENDPOINT=http://127.0.0.1:{LOCAL_HUB_PORT}"
    org = "kernel-hub"  # the registry entry's repo is kernel-hub/<name>, trusted by default
    load = (
        f"k = kernel_hub.get_kernel('{name}', version='==1.0.0'); "
        "print(k.origin.source, k.origin.repo, k.manifest.version)"
    )
    return [
        f"python -m pytest {kernel}/tests",
        f"kernel-hub build {kernel}",
        f"kernel-hub compile-check {name} --tpu v5e",
        f"kernel-hub keygen --out {name}.key --publisher {org} --pin {registry}",
        "mkdir hub-store",
        f"KERNEL_HUB_SERVE_WRITE_TOKEN={token} kernel-hub serve hub-store "
        f"--port {LOCAL_HUB_PORT} &",
        f"{hub} HF_TOKEN={token} kernel-hub publish {kernel} --repo {org}/{name} --sign-key "
        f"{name}.key",
        f'{hub} python -c "import kernel_hub; {load}"',
    ]
