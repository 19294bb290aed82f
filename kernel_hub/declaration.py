"""The kernel declaration: everything kernel-hub reads from a kernel package, in one object.

A kernel package exports ``KERNEL = KernelDeclaration(...)`` (through ``kernel_hub.kernel_api``).
The loader checks it against the kernel's manifest before anyone uses the kernel, and every part
of kernel-hub that needs something from a kernel (the resolver's implementation order, kernelize's
layers and integrations, the benchmark harness, the compile matrices) reads it from here: there is
no attribute lookup with a silent default on a kernel module.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
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
        first use: adapters import transformers/diffusers), an object with the attributes of
        ``FrameworkAdapter``. kernel-hub reads the ``"transformers"`` and ``"diffusers"`` slots.
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
            f"layers[{name!r}] lacks the class attribute {flag} (a bool)"
            for name, cls in self.layers.items()
            if isinstance(cls, type)
            for flag in LAYER_FLAGS
            if not isinstance(inspect.getattr_static(cls, flag, None), bool)
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

    def adapter(self, slot: str, label: str) -> FrameworkAdapter | None:
        """The framework slot's adapter as kernel-hub reads it (see ``FrameworkAdapter.of``)."""
        found = self.integration(slot)
        return None if found is None else FrameworkAdapter.of(found, f"{label} {slot} adapter")

    def table_for(self, op: str) -> ImplementationTable | None:
        """The implementation table dispatching JAX op ``op`` (or the only table)."""
        if len(self.implementation_tables) == 1:
            return self.implementation_tables[0]
        return next((t for t in self.implementation_tables if t.op == op), None)


LAYER_FLAGS = ("has_backward", "can_torch_compile")
"""Class attributes every declared layer states (as in Hugging Face ``kernels``): whether it has
a backward (kernelize's training mode) and traces into one ``torch.compile`` graph."""


@dataclass(frozen=True)
class FrameworkAdapter:
    """What kernel-hub reads from a framework adapter (a kernel's ``integrations`` module, or an
    adapter kernel-hub builds around a kernel's ops).

    ``register()``: registers the kernel with the framework's dispatch table and returns the name
        (or key) to switch a model to.
    ``has_backward`` / ``can_torch_compile``: as for layers (kernelize's training and
        torch_compile modes).
    ``module_problem(module) -> reason | None``: why a module the framework dispatches cannot be
        served exactly (the whole model then stays stock); None when every module is served.
    """

    register: Callable[[], Any]
    has_backward: bool
    can_torch_compile: bool
    module_problem: ModuleCheck | None

    @classmethod
    def of(cls, adapter: Any, label: str) -> FrameworkAdapter:
        """Read an adapter object's attributes; ``KernelHubError`` naming every missing or
        mistyped one (no attribute has a default: each adapter states all four)."""
        if isinstance(adapter, FrameworkAdapter):
            return adapter
        names = [f.name for f in fields(cls)]
        missing = [name for name in names if not hasattr(adapter, name)]
        if missing:
            raise KernelHubError(
                f"{label} lacks {', '.join(missing)} (an adapter states {', '.join(names)})"
            )
        found = cls(**{name: getattr(adapter, name) for name in names})
        problems = [
            f"{flag} is not a bool"
            for flag in LAYER_FLAGS
            if not isinstance(getattr(found, flag), bool)
        ]
        problems += ["register is not callable"] * (not callable(found.register))
        if found.module_problem is not None and not callable(found.module_problem):
            problems.append("module_problem is neither None nor callable")
        if problems:
            raise KernelHubError(f"{label}: {'; '.join(problems)}")
        return found


def submodule_loader(package: str, name: str) -> Callable[[], ModuleType]:
    """A loader for ``integrations=``: imports ``package.name`` when first asked."""
    return lambda: importlib.import_module(f".{name}", package)
