"""The kernel declaration: everything kernel-hub reads from a kernel package, in one object.

A kernel package exports ``KERNEL = KernelDeclaration(...)`` (through ``kernel_hub.kernel_api``).
The loader checks it against the kernel's manifest before anyone uses the kernel, and every part
of kernel-hub that needs something from a kernel (the resolver's implementation order, kernelize's
layers and integrations, the benchmark harness, the compile matrices) reads it from here: there is
no attribute lookup with a silent default on a kernel module.

Builds made for kernel API <= 1.2 export no declaration; ``legacy_declaration`` reads their
module attributes once, in the one place that still knows those names.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType, ModuleType
from typing import Any

from .dispatch import ImplementationTable
from .errors import KernelHubError

ModuleCheck = Callable[[Any], "str | None"]
"""``check(module) -> reason | None``: why a layer cannot serve this module instance."""


@dataclass(frozen=True)
class KernelDeclaration:
    """What a kernel offers kernel-hub. Only ``ops`` and ``jax`` are required.

    ``ops``: torch op name (the manifest's ``ops``) -> the torch callable.
    ``jax``: the kernel's JAX API (a module or namespace of public functions).
    ``implementation_tables``: one ``ImplementationTable`` per dispatching JAX op; the registry's
        ``implementations`` order is applied to each, and its names are checked against them.
    ``layers``: layer name (the manifest's ``layers``) -> ``torch.nn.Module`` class whose
        ``forward`` replaces a framework layer's forward.
    ``module_checks``: layer name -> ``check(module) -> reason | None``: a module instance the
        layer cannot serve exactly is left alone with that reason.
    ``integrations``: framework slot -> a zero-argument loader returning the adapter (imported on
        first use: adapters import transformers/diffusers). Slots read by kernel-hub:
        ``"transformers"`` (``register()``, optional ``module_problem(module)``, ``has_backward``,
        ``can_torch_compile``) and ``"diffusers-attention"``.
    ``mesh_cases``: zero-argument callable giving the sharded compile cases (``MeshCase``).
    ``benchmark_cases``: the kernel's ``KernelCase`` list (``kernel-hub bench``, compile matrix).
    ``torch_implementations``: name -> torch callable timed beside the kernel in benchmarks.
    """

    ops: Mapping[str, Callable[..., Any]]
    jax: Any
    implementation_tables: Sequence[ImplementationTable] = ()
    layers: Mapping[str, type] = field(default_factory=dict)
    module_checks: Mapping[str, ModuleCheck] = field(default_factory=dict)
    integrations: Mapping[str, Callable[[], Any]] = field(default_factory=dict)
    mesh_cases: Callable[[], Sequence[Any]] | None = None
    benchmark_cases: Sequence[Any] = ()
    torch_implementations: Mapping[str, Callable[..., Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("ops", "layers", "module_checks", "integrations", "torch_implementations"):
            object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))
        object.__setattr__(self, "implementation_tables", tuple(self.implementation_tables))
        object.__setattr__(self, "benchmark_cases", tuple(self.benchmark_cases))
        problems = [
            f"ops[{name!r}] is not callable" for name, fn in self.ops.items() if not callable(fn)
        ]
        problems += [
            f"layers[{name!r}] is not a class"
            for name, cls in self.layers.items()
            if not isinstance(cls, type)
        ]
        problems += [
            f"module_checks[{name!r}] names no layer"
            for name in self.module_checks
            if name not in self.layers
        ]
        problems += [
            f"implementation_tables holds {type(t).__name__}, not an ImplementationTable"
            for t in self.implementation_tables
            if not isinstance(t, ImplementationTable)
        ]
        if problems:
            raise KernelHubError("invalid KernelDeclaration: " + "; ".join(problems))

    def integration(self, slot: str) -> Any | None:
        """The adapter for a framework slot, imported now; None when the kernel has none."""
        loader = self.integrations.get(slot)
        return loader() if loader is not None else None

    def table_for(self, op: str) -> ImplementationTable | None:
        """The implementation table dispatching JAX op ``op`` (or the only table)."""
        if len(self.implementation_tables) == 1:
            return self.implementation_tables[0]
        return next((t for t in self.implementation_tables if t.op == op), None)


def submodule_loader(package: str, name: str) -> Callable[[], ModuleType]:
    """A loader for ``integrations=``: imports ``package.name`` when first asked."""
    return lambda: importlib.import_module(f".{name}", package)


def legacy_declaration(module: ModuleType, ops: Sequence[str], layers: Sequence[str]):
    """The declaration of a build made for kernel API <= 1.2, read from its module attributes.

    Such builds exported ``implementation_tables``, ``layers.<Name>`` and
    ``layers.MODULE_CHECKS``, ``integrations`` (Transformers), ``sharding.mesh_cases``,
    ``benchmark.CASES`` and ``benchmark.TORCH_IMPLEMENTATIONS``, each optional.
    """
    missing = [op for op in ops if not callable(getattr(module, op, None))]
    layer_module = getattr(module, "layers", None)
    missing += [f"layers.{name}" for name in layers if not hasattr(layer_module, name)]
    if missing:
        raise KernelHubError(f"does not export: {', '.join(missing)}")
    benchmark = getattr(module, "benchmark", None)
    package = module.__name__

    def mesh_cases() -> list[Any]:
        try:
            sharding = importlib.import_module(f"{package}.sharding")
        except ModuleNotFoundError:
            return []
        return list(getattr(sharding, "mesh_cases", lambda: [])())

    def transformers_integration() -> Any:
        return getattr(module, "integrations", None)

    return KernelDeclaration(
        ops={op: getattr(module, op) for op in ops},
        jax=getattr(module, "jax", None),
        implementation_tables=getattr(module, "implementation_tables", ()),
        layers={name: getattr(layer_module, name) for name in layers},
        module_checks=getattr(layer_module, "MODULE_CHECKS", {}),
        integrations={"transformers": transformers_integration},
        mesh_cases=mesh_cases,
        benchmark_cases=getattr(benchmark, "CASES", ()),
        torch_implementations=getattr(benchmark, "TORCH_IMPLEMENTATIONS", {}),
    )
