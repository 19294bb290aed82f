"""Hot path of a bridged op call: one cached plan per call signature.

The first call with a new signature (static arguments; each tensor's shape, dtype and device)
builds a plan: the stub validates the arguments, the runtime for the device type is looked up and
row buckets are laid out. Later calls with that signature only look the plan up and run it, so
per call there is no argument binding, no validation and no context manager (plain eager calls
keep their plan in the op's cache of direct calls, ``eager.py``, and skip even this lookup). A
stub's verdict may depend only on what the signature holds (it also runs on fake tensors, which
have nothing else).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kernel_hub.dispatch import order_generation
from kernel_hub.errors import UnsupportedDeviceError

from .buckets import RowLayout
from .op_spec import OpSpec, Static, check_argument_types, present_differentiable
from .runtimes import Runtime, runtime_for

Plan = Callable[..., Any]


def _signature(tensors: Sequence[Any]) -> tuple:
    return tuple([None if t is None else (t.shape, t.dtype, t.device) for t in tensors])


def check_devices(arguments: dict[str, Any], tensor_params: Sequence[str]) -> Runtime:
    """The runtime for the one device all tensor arguments share; a clear error when they are on
    several, or when this host cannot run JAX for it."""
    devices = {
        name: arguments[name].device for name in tensor_params if arguments[name] is not None
    }
    if not devices:
        raise UnsupportedDeviceError("a kernel-hub op call needs at least one tensor argument")
    if len({(d.type, d.index) for d in devices.values()}) > 1:
        listing = ", ".join(f"{name} on {device}" for name, device in devices.items())
        raise UnsupportedDeviceError(f"all tensor arguments must be on one device; got {listing}")
    device = next(iter(devices.values()))
    runtime = runtime_for(device.type)
    runtime.check_device(device)
    return runtime


class OpExecutor:
    """Runs one op's forward and backward on torch tensors through the device's runtime."""

    def __init__(self, spec: OpSpec):
        self.spec = spec
        self._forward_plans: dict[tuple, Plan] = {}
        self._backward_plans: dict[tuple, Plan] = {}
        self._order_generation = order_generation()

    def _check_order(self) -> None:
        """Plans traced under another implementation order are stale: drop them."""
        if self._order_generation != order_generation():
            self._forward_plans.clear()
            self._backward_plans.clear()
            self._order_generation = order_generation()

    def forward(self, static: Static, tensors: list[Any]) -> Any:
        return self.forward_plan(static, tensors)(tensors)

    def forward_plan(self, static: Static, tensors: list[Any]) -> Plan:
        """The plan for tensors like ``tensors`` (made and validated on first use); call it with
        a sequence whose first items are the tensors (items after them are ignored, so an op
        whose tensor parameters come first may pass its whole argument tuple)."""
        self._check_order()
        # the static values' types too: 2.0 == 2, but only one of them may be an int argument
        key = (static, tuple(map(type, static)), _signature(tensors))
        plan = self._forward_plans.get(key)
        if plan is None:
            plan = self._forward_plans[key] = self._checking_values(
                static, self._plan_forward(static, tensors)
            )
        return plan

    def _checking_values(self, static: Static, plan: Plan) -> Plan:
        """``plan``, running the op's value check (``OpSpec.check_values``) first on every call."""
        spec = self.spec
        if spec.check_values is None:
            return plan
        count = len(spec.tensor_params)

        def run(tensors: Sequence[Any]) -> Any:
            spec.check_values(**spec.arguments(static, list(tensors[:count])))
            return plan(tensors)

        return run

    def backward(
        self, static: Static, inputs: list[Any], outputs: list[Any], cotangents: list[Any]
    ) -> tuple[Any, ...]:
        """Gradients of the differentiable arguments given as tensors, in their declared order."""
        self._check_order()
        key = (static, _signature(inputs), _signature(outputs), _signature(cotangents))
        plan = self._backward_plans.get(key)
        if plan is None:
            plan = self._backward_plans[key] = self._plan_backward(
                static, inputs, outputs, cotangents
            )
        return plan(inputs, outputs, cotangents)

    def _layout(self, runtime: Runtime, arguments: dict[str, Any]) -> RowLayout | None:
        """Row buckets, for runtimes that compile per input shape and so gain from them."""
        buckets = self.spec.buckets
        if buckets is None or not getattr(runtime, "uses_row_buckets", False):
            return None
        return buckets.layout(arguments)

    def _bucketed_inputs(self) -> list[int]:
        names = self.spec.buckets.inputs
        return [i for i, name in enumerate(self.spec.tensor_params) if name in names]

    def _plan_forward(self, static: Static, tensors: list[Any]) -> Plan:
        spec = self.spec
        arguments = spec.arguments(static, tensors)
        check_argument_types(spec, arguments)
        runtime = check_devices(arguments, spec.tensor_params)
        spec.validate(**arguments)
        if spec.check_values is not None:  # binding may compile, which runs the kernels' trace
            spec.check_values(**arguments)
        fn = spec.jitted("forward", static)
        key = (spec.qualname, "forward", static, self._order_generation)
        layout = self._layout(runtime, arguments)
        if layout is None:
            return _bind(runtime, fn, tensors, key)
        padded_inputs = self._bucketed_inputs()
        padded_outputs = spec.buckets.outputs
        run_padded = _bind(runtime, fn, _pad(tensors, padded_inputs, layout), key)

        def run(tensors: Sequence[Any]) -> Any:
            tensors = list(tensors)
            for i in padded_inputs:
                if tensors[i] is not None:
                    tensors[i] = layout.pad(tensors[i])
            out = run_padded(tensors)
            if isinstance(out, tuple):
                return tuple(_unpad(out, padded_outputs, layout))
            return layout.unpad(out) if 0 in padded_outputs else out

        return run

    def _plan_backward(self, static: Static, inputs: list[Any], outputs, cotangents) -> Plan:
        spec = self.spec
        arguments = spec.arguments(static, inputs)
        runtime = check_devices(arguments, spec.tensor_params)
        fn = spec.jitted("backward", static)
        key = (spec.qualname, "backward", static, self._order_generation)
        layout = self._layout(runtime, arguments)
        if layout is None:
            run = _bind(runtime, fn, [inputs, outputs, cotangents], key)
            return lambda inputs, outputs, cotangents: run([inputs, outputs, cotangents])
        padded_inputs = self._bucketed_inputs()
        padded_outputs = spec.buckets.outputs
        padded_grads = [
            i
            for i, name in enumerate(present_differentiable(spec, inputs))
            if name in spec.buckets.inputs
        ]

        def pad_all(inputs: list[Any], outputs: list[Any], cotangents: list[Any]) -> list[Any]:
            return [
                _pad(inputs, padded_inputs, layout),
                _pad(outputs, padded_outputs, layout),
                _pad(cotangents, padded_outputs, layout, zeros=True),
            ]

        run_padded = _bind(runtime, fn, pad_all(inputs, outputs, cotangents), key)

        def run(inputs: list[Any], outputs: list[Any], cotangents: list[Any]) -> Any:
            grads = run_padded(pad_all(inputs, outputs, cotangents))
            return tuple(_unpad(grads, padded_grads, layout))

        return run


def _bind(runtime: Any, fn: Callable[..., Any], tensors: list[Any], key: tuple) -> Plan:
    """The runtime's call specialised to this signature when it offers one (``bind``). Either
    takes a sequence whose first ``len(tensors)`` items are the tensors, the rest ignored."""
    bind = getattr(runtime, "bind", None)
    if bind is not None:
        return bind(fn, tensors, key=key)
    count = len(tensors)
    return lambda tensors: runtime.call(fn, tensors[:count], key=key)


def _pad(
    tensors: Sequence[Any], positions: Sequence[int], layout: RowLayout, *, zeros: bool = False
) -> list[Any]:
    padded = list(tensors)
    for i in positions:
        if padded[i] is not None:
            padded[i] = layout.pad(padded[i], zeros=zeros)
    return padded


def _unpad(tensors: Sequence[Any], positions: Sequence[int], layout: RowLayout) -> list[Any]:
    return [layout.unpad(t) if i in positions else t for i, t in enumerate(tensors)]
