"""``kernel-hub doctor``: what this machine gives kernel-hub, and what to do about each gap.

Looks without side effects: runtimes are found by their distributions, never imported (torchax
renames torch's PrivateUse1 device on import; torch_tpu needs libtpu to import), and JAX is asked
for devices only where a TPU chip is on the host.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

from kernel_hub.platform import accelerator_present

from .output import print_json, print_table

OK, MISSING, OPTIONAL, INFO = "ok", "missing", "optional", "info"
"""``missing``: a gap in what this host needs; ``optional``: not installed or not set up, needed
only for what its row names (a TPU runtime on a host without TPUs, an extra, hub builds)."""


@dataclass(frozen=True)
class Check:
    area: str
    status: str
    found: str
    todo: str = ""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "doctor",
        help="report runtimes, libtpu and TPU, extras, cache, registry, keys and hub access",
    )
    parser.add_argument("--registry", help="registry file (default: the built-in registry)")
    parser.add_argument(
        "--timeout", type=float, default=3.0, help="seconds to wait for the hub (default 3)"
    )
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(func=run_doctor)


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _required(extra: str, distribution: str) -> SpecifierSet | None:
    """The version range kernel-hub's ``extra`` asks of ``distribution`` (installed wheels)."""
    try:
        requirements = importlib.metadata.requires("kernel-hub") or []
    except importlib.metadata.PackageNotFoundError:  # running from a checkout
        return None
    for text in requirements:
        requirement = Requirement(text)
        same = canonicalize_name(requirement.name) == canonicalize_name(distribution)
        if (
            same
            and requirement.marker is not None
            and requirement.marker.evaluate({"extra": extra})
        ):
            return requirement.specifier
    return None


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def runtime_checks() -> list[Check]:
    """Which torch TPU runtime would carry kernel-hub ops, and libtpu with the TPU generation."""
    runtimes = {
        "TorchTPU (device 'tpu')": ("torch_tpu", "torch-tpu", "torch-tpu"),
        "torchax (device 'jax')": ("torchax", "torchax", "torchax"),
        "PyTorch/XLA (device 'xla')": ("torch_xla", "torch-xla", None),
    }
    checks = []
    for name, (module, distribution, extra) in runtimes.items():
        version = _version(distribution)
        wanted = _required(extra, distribution) if extra else None
        if _installed(module) and wanted is not None and not wanted.contains(version, True):
            checks.append(
                Check(
                    f"runtime: {name}",
                    MISSING,
                    f"{distribution} {version}, but kernel-hub[{extra}] needs {wanted}",
                    f"pip install -c constraints.txt 'kernel-hub[{extra}]'",
                )
            )
        elif _installed(module):
            checks.append(Check(f"runtime: {name}", OK, f"{distribution} {version}"))
        else:
            how = f"pip install 'kernel-hub[{extra}]'" if extra else "docs/running-on-tpu.md"
            checks.append(Check(f"runtime: {name}", _gap(), "not installed", f"for TPUs: {how}"))
    checks.append(Check("runtime: CPU (DLPack)", OK, "always: torch CPU tensors run via JAX CPU"))
    libtpu = _version("libtpu")
    checks.append(
        Check("libtpu", OK, libtpu)
        if libtpu
        else Check(
            "libtpu",
            _gap(),
            "not installed",
            "pip install 'kernel-hub[tpu]' (JAX on TPU, deviceless compile-check)",
        )
    )
    checks.append(_tpu_check(libtpu is not None))
    return checks


def _tpu_check(have_libtpu: bool) -> Check:
    if not accelerator_present():
        return Check(
            "TPU",
            INFO,
            "no TPU chip on this host (/dev/accel*, /dev/vfio)",
            "kernels run their CPU implementations; kernel-hub compile-check compiles for TPUs "
            "without one" + ("" if have_libtpu else " (needs libtpu)"),
        )
    import jax

    from kernel_hub.platform import tpu_generation

    devices = jax.devices()
    if devices[0].platform != "tpu":
        return Check(
            "TPU",
            MISSING,
            f"an accelerator is present but JAX sees {devices[0].platform}",
            "check JAX_PLATFORMS and that libtpu matches jax (pip install 'kernel-hub[tpu]')",
        )
    return Check("TPU", OK, f"{tpu_generation(devices[0])} x {len(devices)}")


def extras_checks() -> list[Check]:
    """Each extra with the modules it installs; the CLI's map of import names to extras."""
    from . import EXTRA_OF_MODULE

    by_extra: dict[str, list[str]] = {}
    for module, extra in EXTRA_OF_MODULE.items():
        by_extra.setdefault(extra, []).append(module)
    checks = []
    for extra, modules in by_extra.items():
        absent = [m for m in modules if not _installed(m)]
        found = ", ".join(m for m in modules if m not in absent) or "-"
        if absent:
            todo = f"pip install 'kernel-hub[{extra}]' (lacks {', '.join(absent)})"
            checks.append(Check(f"extra [{extra}]", OPTIONAL, found, todo))
        else:
            checks.append(Check(f"extra [{extra}]", OK, found))
    return checks


def registry_checks(registry: str | None) -> list[Check]:
    """The registry in use and the publisher keys it pins (no key: every hub load is refused)."""
    from kernel_hub.registry.registry import load_registry

    loaded = load_registry(registry)
    from kernel_hub.bridge.compile_cache import compilation_cache_dir

    compile_cache = compilation_cache_dir()
    checks = [
        Check("registry", OK, f"{loaded.path} ({len(loaded.ops)} ops)"),
        _cache_check(
            "compilation cache",
            compile_cache,
            "set KERNEL_HUB_COMPILATION_CACHE_DIR to a directory only you can write (or "
            "KERNEL_HUB_COMPILATION_CACHE=0): every process compiles every kernel again",
            private=True,
        ),
    ]
    if loaded.publishers:
        pinned = "; ".join(
            f"{p.publisher}: {len(p.keys)} key(s)" for p in loaded.publishers.values()
        )
        checks.append(Check("pinned keys", OK, pinned))
    else:
        checks.append(
            Check(
                "pinned keys",
                OPTIONAL,
                "none: hub builds (get_kernel(version=...), source='hub', verify, mirror) are "
                "refused; in-tree kernels load",
                "pin a publisher's key under publishers: in your registry "
                "(docs/hub-walkthrough.md, docs/trust.md)",
            )
        )
    return checks


def hub_checks(timeout: float) -> list[Check]:
    """The Hugging Face cache in use and whether the hub endpoint answers."""
    if not _installed("huggingface_hub"):
        return [
            Check("hub", MISSING, "huggingface_hub not installed", "pip install 'kernel-hub[hub]'")
        ]
    from kernel_hub.hub import settings

    endpoint = settings.endpoint()
    checks = [
        _cache_check(
            "hub cache",
            Path(settings.cache_dir()),
            "set HF_HUB_CACHE (or HF_HOME) to a writable directory",
        ),
        _cache_check(
            "hub state",
            settings.state_dir(),
            f"set {settings.ENV_STATE_DIR} to a directory only you can write: it keeps the "
            "revocations and index serials this client learned, and loads needing a signed "
            "index are refused without it",
            private=True,
        ),
        Check("trusted publishers", INFO, ", ".join(settings.trusted_publishers()) or "(none)"),
    ]
    if settings.offline():
        checks.append(
            Check("hub", INFO, f"offline (HF_HUB_OFFLINE): cached builds only ({endpoint})")
        )
        return checks
    try:
        with urllib.request.urlopen(endpoint, timeout=timeout):
            pass
        checks.append(Check("hub", OK, f"{endpoint} answers"))
    except urllib.error.HTTPError as exc:  # an HTTP answer, whatever its status: reachable
        checks.append(Check("hub", OK, f"{endpoint} answers (HTTP {exc.code} at /)"))
    except OSError as exc:
        reason = getattr(exc, "reason", exc)
        checks.append(
            Check(
                "hub",
                MISSING,
                f"{endpoint} unreachable: {reason}",
                "set HF_ENDPOINT to a mirror (kernel-hub serve), or HF_HUB_OFFLINE=1 for the cache",
            )
        )
    return checks


def _gap() -> str:
    """A TPU-side component that is not installed: needed on a TPU host, optional elsewhere."""
    return MISSING if accelerator_present() else OPTIONAL


def _cache_check(area: str, directory: Path | None, todo: str, *, private: bool = False) -> Check:
    """Whether kernel-hub can write ``directory`` (or make it: its nearest existing parent must
    be a writable directory) and, for a ``private`` cache, whether no one else can; nothing is
    created."""
    from kernel_hub.user_cache import others_can_write

    if directory is None:
        return Check(area, INFO, "off")
    existing = next(p for p in (directory, *directory.parents) if p.exists())
    if not existing.is_dir():
        return Check(area, MISSING, f"{directory}: {existing} is not a directory", todo)
    if not os.access(existing, os.W_OK | os.X_OK):
        return Check(area, MISSING, f"{directory}: {existing} is not writable", todo)
    shared = others_can_write(directory) if private and existing == directory else None
    if shared is not None:
        return Check(area, MISSING, f"{directory}: not used, {shared}", todo)
    made = "writable" if existing == directory else f"to be made in {existing}"
    return Check(area, OK, f"{directory} ({made})")


def verdict(checks: list[Check]) -> str:
    """One line: ready or not, and what the optional rows would add."""
    gaps = [c.area for c in checks if c.status == MISSING]
    optional = [c.area for c in checks if c.status == OPTIONAL]
    platform = "TPU" if any(c.area == "TPU" and c.status == OK for c in checks) else "CPU"
    later = f"; {len(optional)} optional (install or set up when needed)" if optional else ""
    if gaps:
        return f"verdict: {len(gaps)} to fix ({', '.join(gaps)}){later}"
    return f"verdict: ready: kernel-hub runs its kernels here ({platform}){later}"


def doctor(registry: str | None = None, timeout: float = 3.0) -> list[Check]:
    return [
        *runtime_checks(),
        *extras_checks(),
        *registry_checks(registry),
        *hub_checks(timeout),
    ]


def run_doctor(args: argparse.Namespace) -> int:
    checks = doctor(args.registry, args.timeout)
    if args.json:
        print_json([asdict(c) for c in checks])
        return 0
    rows: list[list[Any]] = [[c.area, c.status, c.found, c.todo or "-"] for c in checks]
    print_table(["check", "status", "found", "what to do"], rows)
    print(f"\n{verdict(checks)}")
    return 0
