"""JAX function -> torch custom op. This is the public API kernels build their torch ops with.

A kernel writes a *stub*: a typed Python function whose signature is the op's schema and whose body
validates the arguments (it runs before any JAX work, for real and for fake tensors). ``jax_op``
turns it into a ``torch.library.custom_op`` that

* runs the JAX function on the tensors' device through the runtime for that device type,
* has a fake (meta) implementation from ``jax.eval_shape``,
* has autograd from the JAX function's VJP, the backward itself a custom op,
* passes non-tensor arguments to JAX as static (hashable) arguments, one compile per value.

    @jax_op(op_namespace(__name__), api.rms_norm, differentiable=("x", "weight"))
    def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
        check_rms_norm(x, weight)
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import torch

from .errors import KernelInputError, UnsupportedDeviceError
from .runtimes import op_defined, runtime_for
from .runtimes.dlpack import needs_x64, tensor_leaves, x64_scope

__all__ = ["JaxOp", "jax_op", "op_namespace", "torch_to_jax_dtype"]

JaxBackward = Callable[..., Sequence[Any]]


def op_namespace(module_name: str) -> str:
    """A torch op namespace unique to a loaded kernel module (two versions never collide)."""
    return re.sub(r"\W", "_", module_name.split(".")[0]).strip("_") or "kernel_hub"


def torch_to_jax_dtype(dtype: torch.dtype) -> Any:
    """The JAX dtype for a torch dtype; a clear error for dtypes JAX cannot hold."""
    name = str(dtype).removeprefix("torch.")
    try:
        return jax.numpy.dtype(name)
    except TypeError:
        raise KernelInputError(f"dtype {dtype} has no JAX equivalent") from None


@dataclass(frozen=True)
class _OpSpec:
    qualname: str
    signature: inspect.Signature
    tensor_params: tuple[str, ...]
    static_params: tuple[str, ...]
    differentiable: tuple[str, ...]
    jax_fn: Callable[..., Any]
    jax_backward: JaxBackward | None
    validate: Callable[..., Any]

    def bind(self, args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return dict(bound.arguments)

    def static_kwargs(self, arguments: dict[str, Any]) -> dict[str, Any]:
        return {name: _hashable(arguments[name]) for name in self.static_params}


def _hashable(value: Any) -> Any:
    return tuple(_hashable(v) for v in value) if isinstance(value, list) else value


def _is_tensor_annotation(annotation: Any) -> bool:
    return annotation in (torch.Tensor, torch.Tensor | None)


def _check_devices(arguments: dict[str, Any], tensor_params: Sequence[str]) -> None:
    """One device for all tensors, and a runtime on this host that can serve it."""
    devices = {
        name: arguments[name].device for name in tensor_params if arguments[name] is not None
    }
    kinds = {(d.type, d.index) for d in devices.values()}
    if len(kinds) > 1:
        listing = ", ".join(f"{name} on {device}" for name, device in devices.items())
        raise UnsupportedDeviceError(f"all tensor arguments must be on one device; got {listing}")
    device = next(iter(devices.values()))
    runtime_for(device.type).check_device(device)


@functools.cache
def _compiled(spec: _OpSpec, static: tuple[tuple[str, Any], ...], role: str) -> Callable[..., Any]:
    """One jitted function per op, static arguments and role (forward/backward)."""
    kwargs = dict(static)
    if role == "forward":
        return jax.jit(functools.partial(spec.jax_fn, **kwargs))
    return jax.jit(functools.partial(_vjp, spec, kwargs))


def _vjp(spec: _OpSpec, static: dict[str, Any], inputs, outputs, cotangents):
    if spec.jax_backward is not None:
        named = dict(zip(spec.tensor_params, inputs, strict=True))
        return tuple(spec.jax_backward(named, tuple(outputs), tuple(cotangents), **static))
    positions = [spec.tensor_params.index(name) for name in spec.differentiable]

    def forward(*diff_args):
        args = list(inputs)
        for position, value in zip(positions, diff_args, strict=True):
            args[position] = value
        return spec.jax_fn(*args, **static)

    primal_out, pullback = jax.vjp(forward, *(inputs[p] for p in positions))
    cotangent = tuple(cotangents) if isinstance(primal_out, tuple) else cotangents[0]
    return tuple(pullback(cotangent))


def _static_key(spec: _OpSpec, arguments: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple(spec.static_kwargs(arguments).items())


def _run(spec: _OpSpec, role: str, static: tuple, tensors: Sequence[Any]) -> Any:
    device_type = tensor_leaves(tensors)[0].device.type
    return runtime_for(device_type).call(
        _compiled(spec, static, role), tensors, key=(spec.qualname, role, static)
    )


def _concrete(size: Any) -> int:
    """A shape entry as an int; symbolic sizes use their example value (see ``_fake_outputs``)."""
    if isinstance(size, torch.SymInt):
        return size.node.hint
    return int(size)


def _fake_outputs(spec: _OpSpec, arguments: dict[str, Any]) -> Any:
    """Output shapes from ``jax.eval_shape``; symbolic input sizes map back to their symbols.

    JAX needs concrete sizes, so symbolic ones are replaced by their example values; an output size
    equal to an input size's example value is given that input size (what torch's duck sizing does).
    """
    tensors = [arguments[name] for name in spec.tensor_params]
    symbols: dict[int, Any] = {}
    for tensor in tensor_leaves(tensors):
        for size in tensor.shape:
            if isinstance(size, torch.SymInt):
                symbols.setdefault(_concrete(size), size)
    structs = [
        None
        if t is None
        else jax.ShapeDtypeStruct(tuple(_concrete(s) for s in t.shape), torch_to_jax_dtype(t.dtype))
        for t in tensors
    ]
    with x64_scope(needs_x64(tensors)):
        shapes = jax.eval_shape(
            functools.partial(spec.jax_fn, **spec.static_kwargs(arguments)), *structs
        )
    like = tensor_leaves(tensors)[0]

    def make(struct):
        shape = [symbols.get(size, size) for size in struct.shape]
        return like.new_empty(shape, dtype=getattr(torch, struct.dtype.name))

    return jax.tree.map(make, shapes)


class JaxOp:
    """A callable torch op backed by a JAX function (``.jax_fn``); ``.op`` is the torch op."""

    def __init__(self, spec: _OpSpec, op: Any, backward_op: Any, stub: Callable[..., Any]):
        self._spec = spec
        self.op = op
        self.backward_op = backward_op
        self.jax_fn = spec.jax_fn
        self.qualname = spec.qualname
        functools.update_wrapper(self, stub)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.op(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<kernel-hub op {self.qualname}{self._spec.signature}>"


def jax_op(
    namespace: str,
    jax_fn: Callable[..., Any],
    *,
    name: str | None = None,
    differentiable: Sequence[str] = (),
    jax_backward: JaxBackward | None = None,
) -> Callable[[Callable[..., Any]], JaxOp]:
    """Decorator: turn a typed, validating stub into a torch custom op running ``jax_fn``.

    ``jax_fn`` takes the stub's tensor arguments positionally (as JAX arrays, None stays None) and
    its other arguments as keywords. ``differentiable`` names the tensor arguments that get
    gradients. ``jax_backward(inputs_by_name, outputs, cotangents, **static)`` may replace the
    default backward (``jax.vjp`` of ``jax_fn``), e.g. to reuse saved outputs; it returns one
    gradient per differentiable argument.
    """

    def decorate(stub: Callable[..., Any]) -> JaxOp:
        signature = inspect.signature(stub, eval_str=True)
        tensor_params = tuple(
            p.name for p in signature.parameters.values() if _is_tensor_annotation(p.annotation)
        )
        unknown = set(differentiable) - set(tensor_params)
        if unknown:
            raise TypeError(f"differentiable names non-tensor arguments: {sorted(unknown)}")
        spec = _OpSpec(
            qualname=f"{namespace}::{name or stub.__name__}",
            signature=signature,
            tensor_params=tensor_params,
            static_params=tuple(p for p in signature.parameters if p not in tensor_params),
            differentiable=tuple(differentiable),
            jax_fn=jax_fn,
            jax_backward=jax_backward,
            validate=stub,
        )
        op = _define_forward(spec, stub)
        backward_op = _define_backward(spec, stub) if differentiable else None
        if backward_op is not None:
            _register_autograd(spec, op, backward_op)
        defined = JaxOp(spec, op, backward_op, stub)
        op_defined(defined)
        return defined

    return decorate


def _define_forward(spec: _OpSpec, stub: Callable[..., Any]) -> Any:
    schema = torch.library.infer_schema(stub, mutates_args=())

    def forward(*args: Any, **kwargs: Any) -> Any:
        arguments = spec.bind(args, kwargs)
        _check_devices(arguments, spec.tensor_params)
        spec.validate(**arguments)
        tensors = [arguments[name] for name in spec.tensor_params]
        return _run(spec, "forward", _static_key(spec, arguments), tensors)

    op = torch.library.custom_op(spec.qualname, forward, mutates_args=(), schema=schema)

    @op.register_fake
    def _(*args: Any, **kwargs: Any) -> Any:
        arguments = spec.bind(args, kwargs)
        _check_devices(arguments, spec.tensor_params)
        spec.validate(**arguments)
        return _fake_outputs(spec, arguments)

    return op


def _backward_schema(spec: _OpSpec) -> str:
    params = [
        inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=a)
        for n, a in (
            ("inputs", list[torch.Tensor | None]),
            ("outputs", list[torch.Tensor]),
            ("cotangents", list[torch.Tensor]),
        )
    ]
    params += [
        spec.signature.parameters[name].replace(default=inspect.Parameter.empty)
        for name in spec.static_params
    ]

    def prototype(*args: Any) -> None: ...

    prototype.__signature__ = inspect.Signature(params, return_annotation=list[torch.Tensor])
    return torch.library.infer_schema(prototype, mutates_args=())


def _define_backward(spec: _OpSpec, stub: Callable[..., Any]) -> Any:
    diff_positions = [spec.tensor_params.index(name) for name in spec.differentiable]

    def backward(inputs, outputs, cotangents, *static_values):
        static = tuple(zip(spec.static_params, map(_hashable, static_values), strict=True))
        return list(_run(spec, "backward", static, [list(inputs), list(outputs), list(cotangents)]))

    op = torch.library.custom_op(
        f"{spec.qualname}_backward", backward, mutates_args=(), schema=_backward_schema(spec)
    )

    @op.register_fake
    def _(inputs, outputs, cotangents, *static_values):
        return [torch.empty_like(inputs[p]) for p in diff_positions]

    return op


def _register_autograd(spec: _OpSpec, op: Any, backward_op: Any) -> None:
    arg_names = list(spec.signature.parameters)

    def setup_context(ctx, inputs, output):
        arguments = dict(zip(arg_names, inputs, strict=True))
        outputs = output if isinstance(output, tuple) else (output,)
        ctx.static_values = [arguments[name] for name in spec.static_params]
        ctx.num_inputs = len(spec.tensor_params)
        ctx.save_for_backward(*(arguments[n] for n in spec.tensor_params), *outputs)

    def backward(ctx, *grads):
        saved = ctx.saved_tensors
        inputs, outputs = list(saved[: ctx.num_inputs]), list(saved[ctx.num_inputs :])
        cotangents = [
            torch.zeros_like(out) if g is None else g for g, out in zip(grads, outputs, strict=True)
        ]
        diff_grads = iter(backward_op(inputs, outputs, cotangents, *ctx.static_values))
        return tuple(
            next(diff_grads) if name in spec.differentiable else None for name in arg_names
        )

    op.register_autograd(backward, setup_context=setup_context)
