"""Load-time layer replacement: ``kernelize`` gives marked modules the registry kernels' forwards.

A module is a candidate when its class is marked with a layer name:

* ``@use_kernel_forward("RMSNorm")`` on the class (it sets ``kernel_layer_name``, the attribute
  Transformers' and Hugging Face ``kernels``' decorators set, so their marks count too);
* ``mark_layer(cls_or_class_name, "RMSNorm")`` for classes you do not own;
* a known class: ``torch.nn.LayerNorm`` (``integrations.torch_nn``), a Transformers or Diffusers
  class (``integrations.transformers``, ``integrations.diffusers``).

The registry's ``layers:`` field says which op provides a layer name. ``kernelize`` replaces only
the instance's ``forward`` (``module.forward = MethodType(layer.forward, module)``); classes,
parameters and buffers stay as they are, so ``unkernelize`` gives back the stock model exactly.
Attention and MoE experts are switched through the frameworks' interfaces instead (each
integration's ``MODEL_INTERFACES``: Transformers' attention and experts interfaces, Diffusers'
attention dispatcher).

What a kernel provides for this:

* ``layers.<Name>``: an ``nn.Module`` subclass with no ``__init__`` whose ``forward`` has the
  same parameters (names, kinds, defaults) as the forward it replaces and reads its state from
  the host module; class attributes ``has_backward`` (default True) and ``can_torch_compile``
  (default False) decide the modes it is used in.
* optionally ``layers.MODULE_CHECKS = {"<Name>": check}``, ``check(module) -> reason | None``,
  for host modules whose state the layer cannot take (a 2-D weight, the meta device...).
* for an interface op: ``integrations.register() -> name`` registering with the interface, and
  module attributes ``has_backward`` / ``can_torch_compile`` with the same defaults; optionally
  ``integrations.module_problem(module) -> reason | None`` for modules that need a feature the
  integration does not implement (the model then keeps its stock implementation).

A candidate that XLA compiles better where it sits (an integration's
``layers_left_to_xla(model)``: Diffusers' per-head q/k norms before a rotary) is left alone with
that reason.

The report lists every candidate, swapped or left alone with the reason; ``kernelize_report``
rebuilds it later from what is still in place (``swaps.py``). A model that Hugging Face
``kernels`` manages (``use_kernels=True``) is refused: that library re-kernelizes it on every
``train()``/``eval()`` and would silently undo kernel-hub's swaps.
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
import types
import weakref
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import torch

from kernel_hub.bridge.runtimes import supported_device_types
from kernel_hub.declaration import FrameworkAdapter
from kernel_hub.errors import KernelHubError, UnknownNameError
from kernel_hub.loading.mappings import Override, active_overrides
from kernel_hub.loading.resolver import get_kernel
from kernel_hub.platform import TORCH_DEVICE_PLATFORMS, Platform
from kernel_hub.registry.registry import Registry, load_registry

from . import quantized_checkpoint, swaps
from .integrations import quantized_fp8_linear
from .modes import Mode
from .report import KernelizeReport, ReportEntry

log = logging.getLogger(__name__)

LAYER_ATTRIBUTE = "kernel_layer_name"
"""Class attribute naming the layer a class can be replaced by (shared with Transformers)."""

ModuleClass = TypeVar("ModuleClass", bound=type)

_marks_by_class: weakref.WeakKeyDictionary[type, str] = weakref.WeakKeyDictionary()
_marks_by_name: dict[str, str] = {}


def _check_layer_name(layer_name: object) -> str:
    if not isinstance(layer_name, str) or not layer_name.isidentifier():
        raise KernelHubError(
            f"a layer name is an identifier such as 'RMSNorm' (see the registry's layers:), "
            f"got {layer_name!r}"
        )
    return layer_name


def use_kernel_forward(layer_name: str) -> Callable[[ModuleClass], ModuleClass]:
    """Class decorator: instances may get the forward of the registry's layer ``layer_name``."""
    _check_layer_name(layer_name)

    def decorate(cls: ModuleClass) -> ModuleClass:
        if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
            raise KernelHubError(
                f"use_kernel_forward decorates torch.nn.Module classes, not {cls!r}"
            )
        setattr(cls, LAYER_ATTRIBUTE, layer_name)
        return cls

    return decorate


def mark_layer(target: type | str, layer_name: str) -> None:
    """Mark a class you do not own (or every class of that name) as replaceable by ``layer_name``.

    ``target`` is a module class (only that exact class) or a class name, plain
    (``"LlamaRMSNorm"``) or qualified (``"transformers.models.llama.modeling_llama.LlamaRMSNorm"``).
    A mark made here wins over the class's own ``kernel_layer_name``.
    """
    _check_layer_name(layer_name)
    if isinstance(target, str) and target:
        _marks_by_name[target] = layer_name
    elif isinstance(target, type) and issubclass(target, torch.nn.Module):
        _marks_by_class[target] = layer_name
    else:
        raise KernelHubError(
            f"mark_layer takes a torch.nn.Module class or a class name, got {target!r}"
        )


def unmark_layer(target: type | str) -> None:
    """Drop a mark made by ``mark_layer`` (a missing mark is not an error)."""
    if isinstance(target, str):
        _marks_by_name.pop(target, None)
    elif isinstance(target, type):
        _marks_by_class.pop(target, None)
    else:
        raise KernelHubError(f"unmark_layer takes a class or a class name, got {target!r}")


def find_mark(module: torch.nn.Module) -> tuple[str, str] | None:
    """(layer name, how it was found) for a candidate module, None for the others."""
    cls = type(module)
    if cls in _marks_by_class:
        return _marks_by_class[cls], "mark_layer"
    for name in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}"):
        if name in _marks_by_name:
            return _marks_by_name[name], "mark_layer"
    hf = _transformers_integration()
    if hf is not None and hf.is_transformers_norm(cls):
        # its probe decides, even over a kernel_layer_name: Transformers' decorators name
        # GPT-OSS's and Gemma's norms "RMSNorm" too, and their math differs from Llama's
        recognised = hf.recognised_layer(cls)
        return (recognised, "recognised") if recognised is not None else None
    marked = getattr(cls, LAYER_ATTRIBUTE, None)
    if isinstance(marked, str):
        return marked, LAYER_ATTRIBUTE
    for integration in _integrations():
        recognised = integration.recognised_layer(cls)
        if recognised is not None:
            return recognised, "recognised"
    return None


def _unrecognised(name: str, module: torch.nn.Module) -> ReportEntry | None:
    """A report entry for a known kind of layer that no kernel layer computes exactly."""
    hf = _transformers_integration()
    cls = type(module)
    if hf is not None and hf.is_gated_mlp_candidate(cls):
        target, reason = "GatedMLP", hf.recognise_gated_mlp(cls).reason
    elif hf is not None and hf.is_transformers_norm(cls):
        target, reason = "RMSNorm", hf.recognise_norm(cls).reason
    elif hf is not None and quantized_fp8_linear.is_fp8_linear(cls):
        target, reason = "QuantizedLinear", quantized_fp8_linear.REASON
    else:
        return None
    return ReportEntry(
        module=name,
        cls=cls.__name__,
        kind="layer",
        target=target,
        found_by="recognised",
        reason=reason,
    )


def _registry_bound(layer_name: str | None, module: torch.nn.Module) -> bool:
    """A gated MLP (recognised or a near miss): a candidate only if the registry has the op."""
    hf = _transformers_integration()
    return hf is not None and (
        layer_name in ("GatedMLP", "FusedGatedMLP") or hf.is_gated_mlp_candidate(type(module))
    )


def _transformers_integration() -> types.ModuleType | None:
    """The Transformers integration, only if Transformers is imported (else no model uses it)."""
    if "transformers" not in sys.modules:
        return None
    from .integrations import transformers as hf

    return hf


def _integrations() -> list[types.ModuleType]:
    """The integrations whose framework is imported (else no model uses it): torch.nn layers,
    Transformers, Diffusers. Each has ``recognised_layer(cls)`` and ``MODEL_INTERFACES`` (and
    may have ``layers_left_to_xla(model)``)."""
    from .integrations import torch_nn

    found = [torch_nn]
    hf = _transformers_integration()
    if hf is not None:
        found.append(hf)
    if "diffusers" in sys.modules:
        from .integrations import diffusers

        found.append(diffusers)
    return found


class _LeftAlone(Exception):
    """Internal: the reason a candidate keeps its stock behaviour."""


def _kernel_label(kernel: types.ModuleType) -> str:
    """``rmsnorm 1.0.0``."""
    return f"{kernel.manifest.name} {kernel.manifest.version}"


class _KernelSource:
    """Resolves ops to loaded kernels for one ``kernelize`` call; remembers why one is unusable."""

    def __init__(self, registry: Registry, mode: Mode, device_type: str):
        self.registry = registry
        self.mode = mode
        self.overrides: dict[str, Override] = active_overrides(registry)
        self.platform, self.device_problem = _platform_for(device_type)
        self._loaded: dict[str, types.ModuleType | str] = {}
        """Op -> its kernel, or the reason it has none."""

    def kernel(self, op: str) -> types.ModuleType:
        """The kernel for ``op`` on this device, or ``_LeftAlone`` saying why there is none."""
        name = self.canonical(op)
        if name is None:
            raise _LeftAlone(f"{self.registry.path.name} has no op {op!r}")
        if name not in self._loaded:
            try:
                self._loaded[name] = self._load(name)
            except _LeftAlone as reason:
                self._loaded[name] = str(reason)
        found = self._loaded[name]
        if isinstance(found, str):
            raise _LeftAlone(found)
        return found

    def _load(self, op: str) -> types.ModuleType:
        override = self.overrides.get(op)
        if override is not None and override.off:
            raise _LeftAlone(override.describe())
        if self.device_problem:
            raise _LeftAlone(self.device_problem)
        entry = self.registry.get(op)
        if entry.overrides_order and not entry.implementations_for(self.platform):
            runs_on = ", ".join(entry.implementations)
            raise _LeftAlone(f"op {op!r} has no kernel for {self.platform} (it runs on: {runs_on})")
        try:
            kernel = get_kernel(
                op,
                registry=self.registry.path,
                version=str(override.version) if override and override.version else None,
                local_dir=override.kernel_dir if override else None,
            )
        except KernelHubError as exc:
            raise _LeftAlone(f"kernel for op {op!r} could not be loaded: {exc}") from None
        if not kernel.manifest.implementations_on(self.platform):
            raise _LeftAlone(
                f"kernel {_kernel_label(kernel)} has no implementation for {self.platform}"
            )
        return kernel

    def canonical(self, op: str) -> str | None:
        """The registry's name for op or alias ``op``, None if the registry lacks it."""
        return self.registry.get(op).name if op in self.registry else None

    def owner(self, layer_name: str) -> str | None:
        """The op whose kernel provides ``layer_name``, if any."""
        try:
            return self.registry.layer_owner(layer_name).name
        except UnknownNameError:
            return None

    def layer(self, layer_name: str) -> tuple[types.ModuleType, type]:
        """(kernel, layer class) providing ``layer_name`` in this mode, or ``_LeftAlone``."""
        op = self.owner(layer_name)
        if op is None:
            provided = sorted({n for entry in self.registry for n in entry.layers})
            raise _LeftAlone(
                f"no op in {self.registry.path.name} provides layer {layer_name!r} "
                f"(layers provided: {', '.join(provided) or 'none'})"
            )
        kernel = self.kernel(op)
        layer_cls = kernel.KERNEL.layers.get(layer_name)
        if layer_cls is None:
            raise _LeftAlone(f"kernel {_kernel_label(kernel)} does not export layers.{layer_name}")
        _check_mode(layer_cls, self.mode, f"{_kernel_label(kernel)} layers.{layer_name}")
        return kernel, layer_cls


def _platform_for(device_type: str) -> tuple[Platform, str | None]:
    platform = TORCH_DEVICE_PLATFORMS.get(device_type)
    if platform is None:
        served = ", ".join(TORCH_DEVICE_PLATFORMS)
        return "cpu", f"kernel-hub has no kernels for device type {device_type!r} (has: {served})"
    if device_type not in supported_device_types():
        have = ", ".join(supported_device_types())
        return platform, f"no kernel-hub runtime for device type {device_type!r} (have: {have})"
    return platform, None


def _check_mode(provider: type | FrameworkAdapter, mode: Mode, label: str) -> None:
    """``_LeftAlone`` when ``provider`` (a declared layer class or a framework adapter, both
    stating ``has_backward`` and ``can_torch_compile``) does not fit ``mode``."""
    if Mode.TRAINING in mode and not provider.has_backward:
        raise _LeftAlone(f"{label} has no backward (has_backward = False), needed in training mode")
    if Mode.TORCH_COMPILE in mode and not provider.can_torch_compile:
        raise _LeftAlone(
            f"{label} does not declare can_torch_compile = True, needed with torch_compile"
        )


def _plain_signature(fn: Callable[..., Any]) -> inspect.Signature:
    """Parameter names, kinds and defaults; annotations dropped (they do not change a call)."""
    params = [
        p.replace(annotation=inspect.Parameter.empty)
        for p in inspect.signature(fn).parameters.values()
    ]
    return inspect.Signature(params)


def signature_problem(module_cls: type, layer_cls: type) -> str | None:
    """Why ``layer_cls.forward`` cannot take every call ``module_cls.forward`` takes, or None."""
    try:
        wanted = _plain_signature(module_cls.forward)
        offered = _plain_signature(layer_cls.forward)
    except (TypeError, ValueError) as exc:
        return f"forward signature cannot be read: {exc}"
    if list(wanted.parameters.values()) == list(offered.parameters.values()):
        return None
    return (
        f"forward signatures differ: {module_cls.__name__}.forward{wanted} vs "
        f"{layer_cls.__module__.rsplit('.', 1)[-1]}.{layer_cls.__name__}.forward{offered}"
    )


def _module_problem(
    kernel: types.ModuleType, layer_name: str, module: torch.nn.Module
) -> str | None:
    """The kernel's own check of the module's state (its declaration's ``module_checks``)."""
    check = kernel.KERNEL.module_checks.get(layer_name)
    problem = check(module) if check is not None else None
    return problem and f"unsupported by {_kernel_label(kernel)} layers.{layer_name}: {problem}"


def _left_to_xla(model: torch.nn.Module) -> dict[torch.nn.Module, str]:
    """Candidate layers whose stock form XLA compiles better where they sit -> why: each
    integration's ``layers_left_to_xla(model)`` (Diffusers: per-head q/k norms before a
    rotary)."""
    kept: dict[torch.nn.Module, str] = {}
    for integration in _integrations():
        found = getattr(integration, "layers_left_to_xla", None)
        if found is not None:
            kept |= found(model)
    return kept


def _swap_layer(
    source: _KernelSource,
    name: str,
    module: torch.nn.Module,
    mark: tuple[str, str],
    left_to_xla: str | None,
) -> ReportEntry:
    layer_name, found_by = mark
    entry = ReportEntry(
        module=name,
        cls=type(module).__name__,
        kind="layer",
        target=layer_name,
        found_by=found_by,
        op=source.owner(layer_name),
    )
    try:
        if left_to_xla:
            raise _LeftAlone(left_to_xla)
        kernel, layer_cls = source.layer(layer_name)
        replaced_by = swaps.foreign_forward(module)
        if replaced_by is not None:
            raise _LeftAlone(
                f"its forward is already replaced on the instance by {replaced_by} (Hugging Face "
                f"kernels' kernelize or other code); kernel-hub does not stack on it"
            )
        problem = signature_problem(type(module), layer_cls) or _module_problem(
            kernel, layer_name, module
        )
        if problem:
            raise _LeftAlone(problem)
    except _LeftAlone as reason:
        return replace(entry, reason=str(reason))
    swap = swaps.LayerSwap(
        layer=layer_name,
        kernel=_kernel_label(kernel),
        forward=layer_cls.forward,
        previous=module.__dict__.get("forward"),
    )
    swaps.install(module, swap)
    return replace(entry, swapped_to=swap.describe())


def _check_modules(
    adapter: FrameworkAdapter, modules: list[tuple[str, torch.nn.Module]], label: str, mode: Mode
) -> None:
    """``_LeftAlone`` when a module needs a feature the adapter lacks: its ``module_problem(module[,
    training=..., compiling=...]) -> reason | None`` (each passed when the hook takes it: some
    features only a training forward, or only an eager one, can serve). The interface is
    switched for the whole model, so one such module keeps every module on its stock
    implementation."""
    check = adapter.module_problem
    if check is None:
        return
    parameters = inspect.signature(check).parameters
    if "training" in parameters:
        check = functools.partial(check, training=bool(mode & Mode.TRAINING))
    if "compiling" in parameters:
        check = functools.partial(check, compiling=bool(mode & Mode.TORCH_COMPILE))
    problems = {type(m).__name__: p for _, m in modules if (p := check(m))}
    if problems:
        raise _LeftAlone(f"unsupported by {label}: " + "; ".join(problems.values()))


def _interface_ops(source: _KernelSource, interface: Any) -> list[str]:
    """The registry ops that may serve ``interface`` in this mode, first choice first: its
    ``inference_op`` (a forward-only kernel, such as the fused MoE layer) when kernelizing for
    inference and the registry has that op, then its ``op``."""
    inference_op = getattr(interface, "inference_op", None)
    if inference_op and Mode.INFERENCE in source.mode and source.canonical(inference_op):
        return [inference_op, interface.op]
    return [interface.op]


def _switch_with(
    source: _KernelSource,
    model: torch.nn.Module,
    interface: Any,
    modules: list[tuple[str, torch.nn.Module]],
    op_name: str,
) -> dict[str, Any]:
    """Switch ``model``'s ``interface`` to ``op_name``'s kernel: {"op", "swapped_to"} or
    {"op", "reason"}."""
    outcome: dict[str, Any] = {"op": source.canonical(op_name)}
    try:
        kernel = source.kernel(op_name)
        label = f"{_kernel_label(kernel)} integrations"
        integration = interface.integration(kernel)
        if integration is None:
            raise _LeftAlone(f"kernel {_kernel_label(kernel)} has no integrations.register()")
        adapter = FrameworkAdapter.of(integration, label)
        _check_mode(adapter, source.mode, label)
        _check_modules(adapter, modules, label, source.mode)
        model_problem = interface.model_problem(model, modules)
        if not model_problem and Mode.TRAINING in source.mode:
            training_problem = getattr(interface, "training_problem", None)
            model_problem = training_problem and training_problem(model, modules)
        if model_problem:
            raise _LeftAlone(model_problem)
        previous = interface.current(model)
        name = interface.switch(model, adapter.register())
        outcome["swapped_to"] = f"{_kernel_label(kernel)} {name!r} (was {previous['']!r})"
        switches = model.__dict__.setdefault(swaps.INTERFACES_ATTRIBUTE, {})
        switches[interface] = swaps.InterfaceSwitch(name, previous)
    except (_LeftAlone, KernelHubError) as reason:
        outcome["reason"] = str(reason)
    return outcome


def _switch_interface(
    source: _KernelSource, model: torch.nn.Module, interface: Any
) -> list[ReportEntry]:
    """Register the op's integration with the interface and make ``model`` dispatch to it.

    Modules the interface sees but cannot reach (``interface.unreached``) are reported as left
    alone with the interface's reason."""
    candidates = _interface_ops(source, interface)
    op = source.canonical(candidates[-1])
    unreached = [
        ReportEntry(
            module=n,
            cls=type(m).__name__,
            kind=interface.kind,
            target=interface.name,
            found_by=interface.name,
            op=op,
            reason=reason,
        )
        for n, m, reason in interface.unreached(model)
    ]
    modules = [(n, m) for n, m in model.named_modules() if interface.dispatches(m)]
    if not modules:
        return unreached
    outcome: dict[str, Any] = {}
    passed_over = []
    for op_name in candidates:
        outcome = _switch_with(source, model, interface, modules, op_name)
        if "swapped_to" in outcome:
            if passed_over:
                outcome["swapped_to"] += f" ({'; '.join(passed_over)})"
            break
        # an op the registry lacks left nothing: its reason says the registry has no such op
        said_by = f"{outcome['op']} left it: " if outcome["op"] else ""
        passed_over.append(said_by + outcome["reason"])
    else:
        outcome["reason"] = "; ".join(passed_over)
    return [
        ReportEntry(
            module=n,
            cls=type(m).__name__,
            kind=interface.kind,
            target=interface.name,
            found_by=interface.name,
            **outcome,
        )
        for n, m in modules
    ] + unreached


def _device_type(model: torch.nn.Module, device: str | torch.device | None) -> str:
    if device is None:
        tensor = next(model.parameters(), None)
        if tensor is None:
            tensor = next(model.buffers(), None)
        return tensor.device.type if tensor is not None else "cpu"
    try:
        device_type = torch.device(device).type
    except (RuntimeError, TypeError) as exc:
        raise KernelHubError(f"invalid device {device!r}: {exc}") from None
    missing = _HOST_CHECKS.get(device_type)
    if missing is not None and not missing[0]():
        raise KernelHubError(
            f"kernelize(device={device!r}): this host has no {device_type!r} device "
            f"({missing[1]}); leave device out to use the model's ({_device_type(model, None)!r})"
        )
    return device_type


_HOST_CHECKS: dict[str, tuple[Callable[[], bool], str]] = {
    "cuda": (lambda: torch.cuda.is_available(), "torch.cuda.is_available() is False"),
    "tpu": (lambda: hasattr(torch, "tpu"), "torch_tpu is not loaded"),
    "jax": (lambda: "torchax" in sys.modules, "torchax is not imported"),
    "xla": (lambda: "torch_xla" in sys.modules, "torch_xla is not imported"),
}
"""Device types kernel-hub serves that a host may lack: how to tell, and what to say."""


def kernelize(
    model: torch.nn.Module,
    *,
    mode: Mode | str | None = None,
    device: str | torch.device | None = None,
    registry: str | Path | None = None,
) -> KernelizeReport:
    """Give every candidate module of ``model`` the forward of its registry kernel; report all.

    ``mode`` (``Mode`` or a string such as ``"inference+torch_compile"``) defaults to TRAINING or
    INFERENCE from ``model.training``. ``device`` (default: where the model's parameters are)
    selects the kernels. Calling it again starts from the stock model. Overrides from
    ``kernel_mapping`` apply. A Transformers model first gets its own copy of its config
    (``integrations.own_config``), so models sharing its config are never switched with it.
    """
    if not isinstance(model, torch.nn.Module):
        raise KernelHubError(f"kernelize takes a torch.nn.Module, got {type(model).__name__}")
    if mode is None:
        mode = Mode.TRAINING if model.training else Mode.INFERENCE
    mode = Mode.parse(mode)
    hf = _transformers_integration()
    managed = hf.hf_kernels_problem(model) if hf is not None else None
    if managed:
        raise KernelHubError(managed)
    device_type = _device_type(model, device)
    source = _KernelSource(load_registry(registry), mode, device_type)
    unkernelize(model)
    if hf is not None:  # switches below write the config: never one another model reads
        from .integrations.own_config import give_own_config

        give_own_config(model)
    entries = []
    left_to_xla = _left_to_xla(model)
    for name, module in model.named_modules():
        mark = find_mark(module)
        if _registry_bound(mark and mark[0], module) and source.owner("GatedMLP") is None:
            continue  # gated MLPs are candidates only with a registry that serves them
        if mark:
            entry = _swap_layer(source, name, module, mark, left_to_xla.get(module))
        else:
            entry = _unrecognised(name, module)
        if entry is not None:
            entries.append(entry)
    for integration in _integrations():
        for interface in integration.MODEL_INTERFACES:
            if getattr(interface, "training_only", False) and Mode.TRAINING not in mode:
                continue  # e.g. the causal-LM loss: nothing to swap outside training
            if getattr(interface, "registry_bound", False) and not source.canonical(interface.op):
                continue  # e.g. the rotary slot: a candidate only with a registry serving it
            entries += _switch_interface(source, model, interface)
    origins = {e.op: source.kernel(e.op).origin.source for e in entries if e.swapped}
    swaps.record_report(
        model,
        KernelizeReport(type(model).__name__, mode.label, device_type, tuple(entries), origins),
    )
    report = kernelize_report(model)
    log.info("%s", report)
    return report


def _interface_undone(model: torch.nn.Module, interface_name: str) -> str | None:
    """Why the recorded switch of interface ``interface_name`` is no longer in place, or None."""
    switches = model.__dict__.get(swaps.INTERFACES_ATTRIBUTE, {})
    for interface, switch in switches.items():
        if interface.name == interface_name:
            now = interface.current(model)[""]
            return None if now == switch.name else f"the model's {interface.kind} is now {now!r}"
    return "unkernelize removed it"


def kernelize_report(model: torch.nn.Module) -> KernelizeReport:
    """The report of ``model``'s last ``kernelize``, every swap checked against the model as it
    is now: a swap undone since (by Hugging Face kernels, ``unkernelize``, an assignment) is
    reported left alone, saying what undid it."""
    report = swaps.verified_report(model, _interface_undone)
    if report is None:
        raise KernelHubError(f"{type(model).__name__} was never kernelized")
    return report


def unkernelize(model: torch.nn.Module) -> list[str]:
    """Undo ``kernelize``: stock forwards and interface implementations; returns what was undone.

    A swap that other code undid since keeps that code's forward (it is not reported).
    """
    restored = [name for name, module in model.named_modules() if swaps.remove(module)]
    for interface, switch in model.__dict__.pop(swaps.INTERFACES_ATTRIBUTE, {}).items():
        if interface.current(model)[""] == switch.name:
            interface.restore(model, switch.previous)
            restored.append(interface.name)
        elif hasattr(interface, "discard"):  # per-module switches other code partly undid
            interface.discard(model)
    return restored


def from_pretrained(
    model_class: Any,
    path: str | Path,
    *,
    mode: Mode | str | None = None,
    device: str | torch.device | None = None,
    registry: str | Path | None = None,
    **kwargs: Any,
) -> torch.nn.Module:
    """``model_class.from_pretrained(path, **kwargs)``, kernelized (the report is logged).

    ``model_class`` is a Transformers model or auto class (``AutoModelForCausalLM``). A local
    quantized checkpoint kernel-hub reads (``quantization_config`` ``quant_method: fp8`` with
    128x128 blocks, ``gptq`` or ``awq`` 4-bit in groups of 128, or ``compressed-tensors`` int8
    per channel) is loaded by kernel-hub instead, its linear weights kept in their stored format
    (Transformers refuses FP8 without a GPU; see ``quantized_checkpoint``); it takes no
    ``kwargs``.
    """
    if quantized_checkpoint.quantization_config(path) is not None:
        if kwargs:
            raise KernelHubError(
                f"from_pretrained of the quantized checkpoint {path}: kernel-hub loads it "
                f"itself and does not implement {sorted(kwargs)}; call it without them"
            )
        model = quantized_checkpoint.load_quantized(model_class, path)
    else:
        model = model_class.from_pretrained(path, **kwargs)
    kernelize(model, mode=mode, device=device, registry=registry)
    return model
