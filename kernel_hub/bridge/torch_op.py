"""JAX function -> torch op. This is the public API kernels build their torch ops with.

A kernel writes a *stub*: a typed Python function whose signature is the op's schema and whose body
validates the arguments (it runs before any JAX work, for real and for fake tensors; for real
tensors once per distinct signature, so it may look only at shapes, dtypes and devices).
``jax_op`` turns it into a torch operator (``torch.library`` define/impl) that

* runs the JAX function on the tensors' device through the runtime for that device type, compiled
  once per signature (``executor.py``, ``runtimes/``),
* has a fake (meta) implementation from ``jax.eval_shape``,
* has autograd from the JAX function's VJP, the backward itself an op,
* passes non-tensor arguments to JAX as static (hashable) arguments, one compile per value,
* optionally pads a row dimension to buckets (``RowBuckets``) so varying lengths share compiles.

    @jax_op(op_namespace(__name__), api.rms_norm, differentiable=("x", "weight"),
            buckets=RowBuckets(inputs=("x",)))
    def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
        check_rms_norm(x, weight)
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import torch

from . import autocast as _autocast
from .buckets import RowBuckets, power_of_two
from .eager import DirectCall, DirectCalls
from .executor import OpExecutor, check_devices
from .import_watch import when_imported
from .op_spec import (
    JaxBackward,
    OpSpec,
    SavedBackward,
    Static,
    check_argument_types,
    hashable,
    present_differentiable,
)
from .runtimes import op_defined
from .tensors import map_tensors, needs_x64, tensor_leaves, torch_to_jax_dtype, x64_scope

__all__ = [
    "JaxOp",
    "RowBuckets",
    "SavedBackward",
    "jax_op",
    "op_namespace",
    "power_of_two",
    "torch_to_jax_dtype",
]


def op_namespace(module_name: str) -> str:
    """A torch op namespace unique to a loaded kernel module (two versions never collide)."""
    return re.sub(r"\W", "_", module_name.split(".")[0]).strip("_") or "kernel_hub"


def _is_tensor_annotation(annotation: Any) -> bool:
    return annotation in (torch.Tensor, torch.Tensor | None)


def _positional(signature: inspect.Signature, args: Sequence[Any], kwargs: dict) -> tuple:
    """Every argument in parameter order."""
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    return tuple(bound.arguments.values())


def _default_tails(signature: inspect.Signature) -> list[tuple]:
    """``tails[n]``: the defaults of every parameter after the first ``n``. The dispatcher calls
    an implementation positionally, leaving out trailing arguments that equal their defaults."""
    defaults = [p.default for p in signature.parameters.values()]
    return [tuple(defaults[n:]) for n in range(len(defaults) + 1)]


def _concrete(size: Any) -> int:
    """A shape entry as an int; symbolic sizes use their example value (see ``_fake_outputs``)."""
    if isinstance(size, torch.SymInt):
        return size.node.hint
    return int(size)


def _fake_outputs(fn: Callable[..., Any], tensors: Sequence[Any]) -> Any:
    """What ``fn`` (a JAX function of ``tensors``, nested lists of tensors and Nones) returns, as
    empty contiguous torch tensors: the shapes and dtypes of ``jax.eval_shape``, the layout of the
    real op's outputs (JAX arrays are dense row-major, and so are the tensors made from them).

    JAX needs concrete sizes, so symbolic ones are replaced by their example values; an output size
    equal to an input size's example value is given that input size (what torch's duck sizing does).
    """
    leaves = tensor_leaves(tensors)
    symbols: dict[int, Any] = {}
    for tensor in leaves:
        for size in tensor.shape:
            if isinstance(size, torch.SymInt):
                symbols.setdefault(_concrete(size), size)

    def struct(t):
        shape = tuple(_concrete(s) for s in t.shape)
        return jax.ShapeDtypeStruct(shape, torch_to_jax_dtype(t.dtype))

    with x64_scope(needs_x64(tensors)):
        shapes = jax.eval_shape(fn, *map_tensors(struct, list(tensors)))
    like = leaves[0]

    def make(struct):
        shape = [symbols.get(size, size) for size in struct.shape]
        return like.new_empty(shape, dtype=getattr(torch, struct.dtype.name))

    return jax.tree.map(make, shapes)


class JaxOp:
    """A callable torch op backed by a JAX function (``.jax_fn``); ``.op`` is the torch
    ``OpOverload`` (what ``torch.library.opcheck`` and ``torch.compile`` see).

    Plain eager calls (see ``eager.py``) skip the dispatcher, which would only route them to the
    implementation: the first call with a signature validates and binds its executable, later
    ones look that call up and make it. Everything else, torch.compile included, goes through
    ``.op``.
    """

    def __init__(
        self,
        spec: OpSpec,
        forward: tuple[Any, Callable[..., Any]],
        backward: tuple[Any, Callable[..., Any] | None],
        stub: Callable[..., Any],
        library: Any,
        direct_call_for: Callable[[tuple], DirectCall],
    ):
        self._spec = spec
        self._library = library  # the registrations live as long as this object
        # (OpOverload, the Python implementation registered for it): runtimes whose tensor
        # classes handle ops themselves (torchax) run the implementation.
        self.op, self.implementation = forward
        self.backward_op, self.backward_implementation = backward
        self._direct = DirectCalls(
            spec.signature, spec.tensor_params, bool(spec.autocast), spec.list_static
        )
        self._direct_call_for = direct_call_for
        self.jax_fn = spec.jax_fn
        self.qualname = spec.qualname
        functools.update_wrapper(self, stub)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        direct = self._direct
        flat = direct.positional(args, kwargs) if kwargs else args
        if flat is not None and not _is_compiling():
            call = direct.find(flat)
            if call is not None:
                return call(flat)
            if direct.allowed(flat):  # checks the context again: ``find`` may have missed for it
                call = self._direct_call_for(flat)  # validates the arguments first
                direct.remember(flat, call)
                return call(flat)
        try:
            return self.op(*args, **kwargs)
        except (RuntimeError, TypeError):
            # the dispatcher's schema error names C++ types; say what was wrong in our terms
            self._check_types(args, kwargs)
            raise

    def _check_types(self, args: tuple, kwargs: dict) -> None:
        try:
            values = _positional(self._spec.signature, args, kwargs)
        except TypeError:
            return  # wrong arguments altogether: the dispatcher's error stands
        check_argument_types(self._spec, dict(zip(self._spec.param_names, values, strict=True)))

    def __repr__(self) -> str:
        return f"<kernel-hub op {self.qualname}{self._spec.signature}>"


def jax_op(
    namespace: str,
    jax_fn: Callable[..., Any],
    *,
    name: str | None = None,
    differentiable: Sequence[str] = (),
    jax_backward: JaxBackward | None = None,
    buckets: RowBuckets | None = None,
    autocast: Sequence[str] = (),
    frozen: Sequence[str] = (),
    check_values: Callable[..., Any] | None = None,
) -> Callable[[Callable[..., Any]], JaxOp]:
    """Decorator: turn a typed, validating stub into a torch op running ``jax_fn``.

    ``jax_fn`` takes the stub's tensor arguments positionally (as JAX arrays, None stays None) and
    its other arguments as keywords. ``differentiable`` names the tensor arguments that get
    gradients. ``jax_backward(inputs_by_name, outputs, cotangents, **static)`` may replace the
    default backward (``jax.vjp`` of ``jax_fn``), e.g. to reuse saved outputs; it returns one
    gradient per differentiable argument. A ``SavedBackward`` (a backward taking the tensors, the
    outputs and the cotangents positionally) is checked by name against the stub like ``jax_fn``.
    ``buckets`` declares a row axis that may be padded (see ``RowBuckets``; then ``jax_fn``
    receives the bucketed inputs as ``[rows, *features]``).
    ``autocast`` names the floating tensor arguments cast to the autocast dtype inside a
    ``torch.autocast`` region (see ``autocast.py``). A differentiable argument may be optional
    (``Tensor | None``); it gets a gradient when given (``jax_backward`` returns None for it when
    it is None). ``frozen`` names tensor arguments that get no gradient (quantized weights): a
    call in grad mode where one requires grad is refused (``KernelInputError``) before any kernel
    runs, where it would otherwise get none silently. ``check_values(**arguments)`` runs before
    every call's kernel (the stub, once per signature): checks of values, which a later call with
    the same shapes may break.
    """

    def decorate(stub: Callable[..., Any]) -> JaxOp:
        signature = inspect.signature(stub, eval_str=True)
        odd = [
            p.name
            for p in signature.parameters.values()
            if p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD
        ]
        if odd:
            raise TypeError(
                f"{stub.__name__}: parameters {odd} are keyword-only, positional-only or "
                "variadic; an op stub takes plain parameters (name: type [= default])"
            )
        tensor_params = tuple(
            p.name for p in signature.parameters.values() if _is_tensor_annotation(p.annotation)
        )
        unknown = set(differentiable) - set(tensor_params)
        if unknown:
            raise TypeError(f"differentiable names non-tensor arguments: {sorted(unknown)}")
        not_tensors = set(buckets.inputs if buckets else ()) - set(tensor_params)
        if not_tensors:
            raise TypeError(f"buckets name non-tensor arguments: {sorted(not_tensors)}")
        not_cast = set(autocast) - set(tensor_params)
        if not_cast:
            raise TypeError(f"autocast names non-tensor arguments: {sorted(not_cast)}")
        if set(frozen) - (set(tensor_params) - set(differentiable)) or (
            frozen and not differentiable
        ):
            raise TypeError(
                f"frozen names {sorted(frozen)}: it takes non-differentiable tensor arguments of "
                f"an op with differentiable ones ({sorted(differentiable)})"
            )
        static_params = tuple(p for p in signature.parameters if p not in tensor_params)
        _check_contract(stub.__name__, "JAX function", jax_fn, tensor_params, static_params)
        if isinstance(jax_backward, SavedBackward):
            _check_contract(
                stub.__name__,
                "JAX backward",
                jax_backward.fn,
                (*tensor_params, *jax_backward.saved),
                static_params,
            )
        spec = OpSpec(
            qualname=f"{namespace}::{name or stub.__name__}",
            signature=signature,
            tensor_params=tensor_params,
            static_params=static_params,
            differentiable=tuple(differentiable),
            jax_fn=jax_fn,
            jax_backward=jax_backward,
            validate=stub,
            buckets=buckets,
            autocast=tuple(autocast),
            frozen=tuple(frozen),
            check_values=check_values,
        )
        executor = OpExecutor(spec)
        library = torch.library.Library(namespace, "FRAGMENT")
        op, forward, direct_call_for = _define_forward(library, spec, executor, stub)
        backward_op = backward = None
        if differentiable:
            backward_op, backward = _define_backward(library, spec, executor)
            _register_autograd(library, spec, op, backward_op, forward)
        if autocast:
            _autocast.register(library, op, [spec.param_names.index(n) for n in autocast])
        defined = JaxOp(
            spec, (op, forward), (backward_op, backward), stub, library, direct_call_for
        )
        _register_dtensor_rule(spec, op, backward_op)
        op_defined(defined)
        return defined

    return decorate


_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _check_contract(
    stub: str,
    what: str,
    fn: Callable[..., Any],
    tensor_params: Sequence[str],
    static_params: Sequence[str],
) -> None:
    problems = contract_problems(fn, tensor_params, static_params)
    if problems:
        raise TypeError(f"{stub}: the stub and its {what} disagree: " + "; ".join(problems))


def contract_problems(
    jax_fn: Callable[..., Any], tensor_params: Sequence[str], static_params: Sequence[str]
) -> list[str]:
    """How ``jax_fn`` fails the call the bridge makes, by name: the stub's tensor arguments
    positionally in the stub's order (so the JAX function's first parameters carry the same
    names), the others as keywords; and its sharding rule (``sharded``) with one operand per
    tensor argument. Checked when the op is defined, not discovered as a wrong operand later."""
    from ..sharding import ShardingRule
    from ..sharding.boundary import rule_of

    try:
        params = list(inspect.signature(jax_fn).parameters.values())
    except (TypeError, ValueError) as exc:
        return [f"its signature cannot be read ({exc})"]
    problems = []
    leading = [p.name for p in params if p.kind in _POSITIONAL][: len(tensor_params)]
    if not any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params) and leading != list(
        tensor_params
    ):
        problems.append(
            f"the JAX function's first parameters are ({', '.join(leading)}), the stub's tensor "
            f"arguments ({', '.join(tensor_params)})"
        )
    named = {p.name: p for p in params}
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        unknown = [
            name
            for name in static_params
            if name not in named
            or named[name].kind
            not in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
            or name in leading
        ]
        if unknown:
            problems.append(f"the JAX function takes no keyword {', '.join(unknown)}")
    unfilled = [
        p.name
        for p in params
        if p.default is inspect.Parameter.empty
        and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        and p.name not in tensor_params
        and p.name not in static_params
    ]
    if unfilled:
        problems.append(f"the JAX function requires {', '.join(unfilled)}, which the stub lacks")
    rule = rule_of(jax_fn)
    if isinstance(rule, ShardingRule) and len(rule.operands) != len(tensor_params):
        problems.append(
            f"sharding rule {rule.op!r} ({rule}) has {len(rule.operands)} operands, the stub "
            f"{len(tensor_params)} tensor arguments ({', '.join(tensor_params)})"
        )
    return problems


def _register_dtensor_rule(spec: OpSpec, op: Any, backward_op: Any) -> None:
    """DTensor strategies from the JAX function's sharding rule (see ``kernel_hub.sharding``),
    so DTensor inputs (sequence-parallel norms, tensor-parallel plans) run the op per shard."""
    from ..sharding.boundary import choose_rule, rule_of

    rule = rule_of(spec.jax_fn)
    if rule is None or not torch.distributed.is_available():
        return
    from ..sharding import ShardingRule, dtensor

    def rule_for(static: dict[str, Any], ranks: Sequence[int | None]) -> ShardingRule:
        return choose_rule(rule, static, ranks)

    def register(_module: Any) -> None:
        dtensor.register(
            op, backward_op, rule_for, spec.param_names, spec.tensor_params, spec.differentiable
        )

    # No DTensor exists before torch.distributed.tensor is imported, and importing it (with
    # sympy, through torch.fx's symbolic shapes) is most of loading a kernel: wait for it.
    when_imported("torch.distributed.tensor", register)


# Dynamo reads this as True while it traces a call; torch.export's non-strict tracing (which
# ``torch.compiler.is_compiling`` also reports, one frame dearer) runs on tensor subclasses under
# dispatch modes, which ``DirectCalls`` already sends to the dispatcher.
_is_compiling = torch.compiler.is_dynamo_compiling


def _untraced(kernel: Callable[..., Any]) -> Callable[..., Any]:
    """``kernel`` (entered from the dispatcher) never traced by torch.compile, nor what it calls.

    Marking the code object costs nothing per call; ``torch._disable_dynamo``'s wrapper (the
    fallback where that internal API is missing) costs two Python frames per call.
    """
    try:
        from torch._C._dynamo.eval_frame import (
            _FrameAction,
            _FrameExecStrategy,
            set_code_exec_strategy,
        )

        skip = _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP)
        set_code_exec_strategy(kernel.__code__, skip)
    except (ImportError, AttributeError, TypeError):
        return torch._disable_dynamo(kernel)
    return kernel


def _define(library: Any, qualname: str, schema: str, impl: Callable[..., Any]) -> Any:
    """Define ``qualname`` with ``schema`` and its one implementation (every backend); the
    ``OpOverload``. The implementation never runs under torch.compile's frame evaluation."""
    namespace, op_name = qualname.split("::")
    library.define(op_name + schema)
    library.impl(op_name, _untraced(impl), "CompositeExplicitAutograd")
    return getattr(getattr(torch.ops, namespace), op_name).default


def _define_forward(
    library: Any, spec: OpSpec, executor: OpExecutor, stub: Callable
) -> tuple[Any, Callable[..., Any], Callable[[tuple], DirectCall]]:
    """The forward op, its implementation (which the autograd kernel may call directly) and the
    maker of the op's cached direct calls (``eager.py``)."""
    names = spec.param_names
    tensor_positions = [names.index(n) for n in spec.tensor_params]
    static_positions = [names.index(n) for n in spec.static_params]
    tails = _default_tails(spec.signature)
    required = sum(p.default is inspect.Parameter.empty for p in spec.signature.parameters.values())
    list_static = spec.list_static

    def split(args: tuple) -> tuple[Static, list[Any]]:
        """Positional arguments (trailing defaults may be left out) -> (static, tensors)."""
        args += tails[len(args)]
        static = tuple([args[i] for i in static_positions])
        return hashable(static) if list_static else static, [args[i] for i in tensor_positions]

    def forward(*args: Any, **kwargs: Any) -> Any:
        if kwargs or not required <= len(args) <= len(names):
            args = _positional(spec.signature, args, kwargs)
        return executor.forward(*split(args))

    def direct_call_for(args: tuple) -> DirectCall:
        """The call for arguments like ``args`` (positional, as ``DirectCalls.allowed`` took
        them): their plan, bound once, fed the tensor arguments."""
        plan = executor.forward_plan(*split(args))
        count = len(tensor_positions)
        if tensor_positions == list(range(count)) and len(args) >= count:
            return plan  # the tensors lead the arguments: the plan takes the whole tuple
        tail = tails[len(args)]
        return lambda args: plan([(args + tail)[i] for i in tensor_positions])

    def fake(*args: Any, **kwargs: Any) -> Any:
        arguments = dict(zip(names, _positional(spec.signature, args, kwargs), strict=True))
        check_argument_types(spec, arguments)
        check_devices(arguments, spec.tensor_params)
        spec.validate(**arguments)
        static = {name: hashable(arguments[name]) for name in spec.static_params}
        fn = functools.partial(spec.jax_fn, **static)
        return _fake_outputs(fn, [arguments[name] for name in spec.tensor_params])

    op = _define(library, spec.qualname, torch.library.infer_schema(stub, mutates_args=()), forward)
    torch.library.register_fake(spec.qualname, fake, lib=library)
    return op, forward, direct_call_for


def _backward_schema(spec: OpSpec) -> str:
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

    # One tensor per gradient, not a list: DTensor's sharding strategies need fixed returns.
    gradients = tuple.__class_getitem__((torch.Tensor,) * len(spec.differentiable))
    prototype.__signature__ = inspect.Signature(params, return_annotation=gradients)
    return torch.library.infer_schema(prototype, mutates_args=())


def _define_backward(
    library: Any, spec: OpSpec, executor: OpExecutor
) -> tuple[Any, Callable[..., Any]]:
    """The backward op (inputs, outputs, cotangents, *static) -> gradients, and its
    implementation."""
    list_static = spec.list_static

    diff_positions = [spec.tensor_params.index(name) for name in spec.differentiable]

    def _with_placeholders(grads, inputs) -> tuple:
        """One tensor per differentiable argument (the schema's fixed returns): an empty one
        for an optional argument given as None, whose gradient the autograd kernel drops."""
        grads = iter(grads)
        like = next(t for t in inputs if t is not None)
        return tuple(
            like.new_empty(0) if inputs[p] is None else next(grads) for p in diff_positions
        )

    def backward(inputs, outputs, cotangents, *static_values):
        static = hashable(static_values) if list_static else static_values
        return _with_placeholders(executor.backward(static, inputs, outputs, cotangents), inputs)

    def fake(inputs, outputs, cotangents, *static_values):
        static = hashable(static_values) if list_static else static_values
        grads = _fake_outputs(spec.jitted("backward", static), [inputs, outputs, cotangents])
        return _with_placeholders(grads, inputs)

    qualname = f"{spec.qualname}_backward"
    op = _define(library, qualname, _backward_schema(spec), backward)
    torch.library.register_fake(qualname, fake, lib=library)
    return op, backward


def _register_autograd(
    library: Any, spec: OpSpec, op: Any, backward_op: Any, forward: Callable[..., Any]
) -> None:
    """Autograd for ``op``: the backward op on the saved inputs and outputs.

    What ``torch.library.register_autograd`` does, plus a shortcut: when nothing needs a gradient
    and the tensors are plain CPU/CUDA ones (no fake, functional or traced tensors, no dispatch
    mode: the redispatch would land straight in ``forward``), ``forward`` is called directly.
    That saves a redispatch through the dispatcher on every inference call.

    Outputs stay the caller's to modify in place, as a stock op's are (XLM scales a LayerNorm's
    output by a mask): they are saved only for a backward that reads them (``jax_backward``; the
    derived backward recomputes from the inputs and is handed the cotangents, which have the
    outputs' shapes and dtypes, in their place), and an output that is a view of the runtime's
    buffer (rows unpadded, leading dimensions restored) is returned detached, since torch
    refuses in-place ops on a view a custom Function returns.
    """
    arg_names = spec.param_names
    tails = _default_tails(spec.signature)
    tensor_positions = [arg_names.index(n) for n in spec.tensor_params]
    static_positions = [arg_names.index(n) for n in spec.static_params]
    below_autograd = torch._C._after_autograd_keyset
    direct_keys = (torch._C.DispatchKey.CPU, torch._C.DispatchKey.CUDA)
    reads_outputs = spec.jax_backward is not None

    class Backprop(torch.autograd.Function):
        @staticmethod
        def forward(ctx, keyset, *args):
            with torch._C._AutoDispatchBelowAutograd():
                output = op.redispatch(keyset & below_autograd, *args)
            ctx.num_args = len(args)  # the dispatcher drops trailing arguments left at default
            args += tails[len(args)]
            ctx.static_values = [args[i] for i in static_positions]
            outputs = output if isinstance(output, tuple) else (output,)
            if any(out._is_view() for out in outputs):
                outputs = tuple(out.detach() if out._is_view() else out for out in outputs)
                output = outputs if isinstance(output, tuple) else outputs[0]
            saved = outputs if reads_outputs else ()
            ctx.save_for_backward(*(args[i] for i in tensor_positions), *saved)
            return output

        @staticmethod
        def backward(ctx, *grads):
            saved = ctx.saved_tensors
            count = len(tensor_positions)
            inputs, outputs = list(saved[:count]), list(saved[count:])
            if reads_outputs:
                cotangents = [
                    torch.zeros_like(out) if g is None else g
                    for g, out in zip(grads, outputs, strict=True)
                ]
            else:  # grads are materialised (zeros for an unused output): never None here
                cotangents = outputs = list(grads)
            present = present_differentiable(spec, inputs)
            diff_grads = dict(
                zip(
                    spec.differentiable,
                    backward_op(inputs, outputs, cotangents, *ctx.static_values),
                    strict=True,
                )
            )
            per_arg = [diff_grads[n] if n in present else None for n in arg_names]
            return (None, *per_arg[: ctx.num_args])

    frozen = [(arg_names.index(n), n) for n in spec.frozen]
    op_name = spec.qualname.split("::")[1]

    def refuse_frozen(args: tuple) -> None:
        """A frozen argument asking for a gradient it would silently not get."""
        from kernel_hub.errors import KernelInputError

        for position, name in frozen:
            value = args[position] if position < len(args) else None
            if isinstance(value, torch.Tensor) and value.requires_grad:
                raise KernelInputError(
                    f"{op_name}: {name} requires grad, but {op_name} gives it no gradient (it "
                    f"is frozen; differentiable: {', '.join(spec.differentiable)}); pass it with "
                    f"requires_grad=False (e.g. .detach()) or call under torch.no_grad()"
                )

    def autograd_kernel(keyset: Any, *args: Any) -> Any:
        if torch.is_grad_enabled() and any(
            isinstance(a, torch.Tensor) and a.requires_grad for a in args
        ):
            refuse_frozen(args)
            return Backprop.apply(keyset, *args)
        below = keyset & below_autograd
        if below.highestPriorityTypeId() in direct_keys:
            return forward(*args)
        with torch._C._AutoDispatchBelowAutograd():
            return op.redispatch(below, *args)

    library.impl(
        spec.qualname.split("::")[1],
        _untraced(autograd_kernel),
        "Autograd",
        with_keyset=True,
    )
