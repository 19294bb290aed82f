"""``kernel-hub new-kernel NAME --from-jax module:function``: a kernel wrapping a JAX function.

The function is imported and read before anything is written: parameters without a default are
its array operands, parameters whose default is a bool, int, float or str are the op's static
options, parameters defaulting to None are left at their default (listed in the generated API);
anything else (``*args``, ``**kwargs``, other defaults) is refused. It is traced once
(``jax.eval_shape``) on float32 example arrays (``--example-shapes``, else (8, 128) each) for
its result shape and whether ``jax.grad`` goes through it. The generated kernel calls the
function itself from its implementation table ("jax"), so its tests compare the op (JAX and
torch) with the function, which stays the reference until the author adds a reference and a
kernel of their own.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from kernel_hub.errors import KernelHubError

DEFAULT_SHAPE = (8, 128)
OPTION_TYPES = (bool, int, float, str)
IMPLEMENTATION = "jax"
PLATFORMS = ("tpu", "gpu", "cpu")
RESERVED = frozenset(
    {"implementation", "wrapped", "api", "check_inputs", "check_rank", "jax", "torch"}
)
"""Names the generated functions use inside bodies or annotations that take the parameters."""


@dataclass(frozen=True)
class Option:
    """A static option of the op: a parameter of the function with a scalar default."""

    name: str
    type_name: str
    default: bool | int | float | str


@dataclass(frozen=True)
class WrappedFunction:
    """What the generated kernel needs to know about the function it wraps."""

    module: str
    name: str
    arrays: tuple[str, ...]
    keyword_arrays: frozenset[str]
    options: tuple[Option, ...]
    left_at_default: tuple[str, ...]
    shapes: dict[str, tuple[int, ...]]
    result_shape: tuple[int, ...]
    grad_problem: str | None
    """Why ``jax.grad`` does not go through the function, or None when it does."""
    platforms: tuple[str, ...]
    """Where it runs: it lowers for TPU, for the CPU (then XLA GPU is assumed too)."""
    lowering_problems: dict[str, str]
    """Why it does not lower for a platform it leaves out (a Mosaic kernel on the CPU)."""
    requirement: tuple[str, str] | None
    """(distribution, installed version) providing the module, or None for a local module."""

    @property
    def spec(self) -> str:
        return f"{self.module}:{self.name}"


def parse_shapes(text: str | None, arrays: tuple[str, ...], spec: str) -> dict[str, tuple]:
    """``"x=8,128 y=128"`` -> {name: shape}; every array operand needs one when given."""
    if text is None:
        return dict.fromkeys(arrays, DEFAULT_SHAPE)
    shapes = {}
    for item in text.replace(";", " ").split():
        name, _, dims = item.partition("=")
        try:
            shape = tuple(int(d) for d in dims.split(",") if d.strip())
        except ValueError:
            shape = None
        if not name or shape is None or any(d < 1 for d in shape):
            raise KernelHubError(
                f"--example-shapes {text!r}: {item!r} is not NAME=D,D,... with positive sizes "
                f"(e.g. {' '.join(f'{a}=8,128' for a in arrays)})"
            )
        shapes[name] = shape
    if set(shapes) != set(arrays):
        raise KernelHubError(
            f"--example-shapes names {sorted(shapes)} but {spec}'s array parameters are "
            f"{list(arrays)}: give one NAME=D,D,... for each"
        )
    return {name: shapes[name] for name in arrays}


def inspect_function(spec: str, example_shapes: str | None = None) -> WrappedFunction:
    """Import ``module:function``, sort its parameters and trace it on example arrays; every
    problem raises ``KernelHubError`` saying what is wrong and what would be accepted."""
    module_name, sep, name = spec.partition(":")
    if not sep or not module_name or not name.isidentifier():
        raise KernelHubError(f"--from-jax {spec!r}: expected module:function (e.g. jax.nn:gelu)")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise KernelHubError(
            f"--from-jax {spec}: module {module_name!r} does not import here ({exc}); install it "
            "or put its directory on PYTHONPATH (the kernel imports it wherever it loads)"
        ) from None
    function = getattr(module, name, None)
    if not callable(function):
        raise KernelHubError(f"--from-jax {spec}: {module_name} has no function {name!r}")
    arrays, keyword_arrays, options, left = _parameters(spec, function)
    shapes = parse_shapes(example_shapes, arrays, spec)
    result_shape, grad_problem, problems = _trace(spec, function, arrays, keyword_arrays, shapes)
    return WrappedFunction(
        module=module_name,
        name=name,
        arrays=arrays,
        keyword_arrays=frozenset(keyword_arrays),
        options=options,
        left_at_default=left,
        shapes=shapes,
        result_shape=result_shape,
        grad_problem=grad_problem,
        platforms=tuple(p for p in PLATFORMS if p not in problems),
        lowering_problems=problems,
        requirement=_distribution(module_name),
    )


def _parameters(spec: str, function) -> tuple[tuple, set, tuple, tuple]:
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError) as exc:
        raise KernelHubError(f"--from-jax {spec}: its signature cannot be read ({exc})") from None
    arrays, keyword_arrays, options, left, refused = [], set(), [], [], []
    for p in signature.parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            refused.append(f"{p} (variadic)")
        elif p.default is p.empty:
            if options or left:
                refused.append(f"{p.name} (an array after options)")
            arrays.append(p.name)
            if p.kind is p.KEYWORD_ONLY:
                keyword_arrays.add(p.name)
        elif p.default is None:
            left.append(p.name)
        elif type(p.default) in OPTION_TYPES and p.kind is not p.POSITIONAL_ONLY:
            options.append(Option(p.name, type(p.default).__name__, p.default))
        else:
            refused.append(f"{p.name}={p.default!r} (not a bool, int, float, str or None)")
    if refused or not arrays:
        why = f"parameters {', '.join(refused)}" if refused else "no array parameter"
        raise KernelHubError(
            f"--from-jax {spec}: {why}. An op takes array parameters (no default) first, then "
            "options defaulting to a bool, int, float or str (parameters defaulting to None are "
            "left at None); wrap the function in one of that shape"
        )
    taken = sorted(RESERVED & {*arrays, *(o.name for o in options)})
    if taken:
        raise KernelHubError(
            f"--from-jax {spec}: parameter {taken[0]!r} is a name the generated kernel uses "
            f"({', '.join(sorted(RESERVED))}); wrap the function to rename it"
        )
    return tuple(arrays), keyword_arrays, tuple(options), tuple(left)


def _trace(spec: str, function, arrays, keyword_arrays, shapes) -> tuple:
    """Its result shape, why ``jax.grad`` fails (or None) and why it does not lower for a
    platform (platform -> reason)."""
    import jax
    import jax.numpy as jnp

    examples = [jax.ShapeDtypeStruct(shapes[n], jnp.float32) for n in arrays]

    def call(*values):
        named = dict(zip(arrays, values, strict=True))
        positional = [named[n] for n in arrays if n not in keyword_arrays]
        return function(*positional, **{n: named[n] for n in keyword_arrays})

    try:
        result = jax.eval_shape(call, *examples)
    except Exception as exc:  # the user's function: any failure is a wrong example
        shown = " ".join(f"{n}={','.join(map(str, s))}" for n, s in shapes.items())
        raise KernelHubError(
            f"--from-jax {spec}: calling it on float32 arrays {shown} failed ({_why(exc)}); pass "
            "shapes it takes with --example-shapes NAME=D,D,... for each array parameter"
        ) from None
    if not isinstance(result, jax.ShapeDtypeStruct):
        raise KernelHubError(
            f"--from-jax {spec}: it returns {type(result).__name__}, not one array; the generated "
            "op has one array result (wrap the function to return one)"
        )
    problems = {}
    traced = jax.jit(call).trace(*examples)
    for platform in ("tpu", "cpu"):
        try:
            traced.lower(lowering_platforms=(platform,))
        except Exception as exc:  # e.g. a Mosaic kernel on the CPU
            problems[platform] = _why(exc)
    if "cpu" in problems:
        problems["gpu"] = "it does not lower for the CPU either, so it is no plain XLA code"
    if len(problems) == len(PLATFORMS):
        raise KernelHubError(f"--from-jax {spec}: it lowers for no platform ({problems['tpu']})")
    if not jnp.issubdtype(result.dtype, jnp.floating):
        return tuple(result.shape), f"its result is {result.dtype}, not floating point", problems

    def total(*values):
        return jnp.sum(call(*values).astype(jnp.float32))

    try:
        jax.eval_shape(jax.grad(total, argnums=tuple(range(len(arrays)))), *examples)
    except Exception as exc:  # e.g. a pallas_call without a custom_vjp
        return tuple(result.shape), f"jax.grad fails ({_why(exc)})", problems
    return tuple(result.shape), None, problems


def _why(exc: Exception) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def _distribution(module_name: str) -> tuple[str, str] | None:
    top = module_name.split(".")[0]
    for dist in metadata.packages_distributions().get(top, []):
        return dist, metadata.version(dist)
    return None


def factors(wrapped: WrappedFunction) -> dict[str, tuple[str, ...]]:
    """One factor name per dimension of each array operand (``x0 x1``)."""
    return {n: tuple(f"{n}{d}" for d in range(len(s))) for n, s in wrapped.shapes.items()}


def sharding_rule(wrapped: WrappedFunction, spec: str) -> tuple[str, tuple[str, ...]]:
    """The rule text and its whole factors: every dimension whole, so under a mesh the op runs
    on gathered (replicated) inputs until the author states which dimensions may be split. A
    result dimension is named after an operand dimension of the same size when there is one
    (the names only tie dimensions together; nothing whole is split)."""
    named = factors(wrapped)
    pool = [(f, wrapped.shapes[n][d]) for n, fs in named.items() for d, f in enumerate(fs)]
    result = []
    for size in wrapped.result_shape:
        free = [f for f, s in pool if f not in result]
        same = [f for f, s in pool if s == size and f not in result]
        if not free:
            raise KernelHubError(
                f"--from-jax {spec}: its result has more dimensions ({len(wrapped.result_shape)}) "
                "than its operands together; kernel-hub's sharding rule names each result "
                "dimension after an operand's: wrap the function"
            )
        result.append((same or free)[0])
    text = f"{', '.join(' '.join(fs) for fs in named.values())} -> {' '.join(result)}"
    return text, tuple(f for fs in named.values() for f in fs)


def _py(value) -> str:
    """Python source of a tuple or dict of identifiers, double-quoted as ruff formats it."""
    return repr(value).replace("'", '"')


def _indent(lines: list[str], spaces: int) -> str:
    return "\n".join(" " * spaces + line for line in lines)


def render(values: dict[str, str], wrapped: WrappedFunction) -> dict[Path, str]:
    """The kernel's files (path inside the kernel directory -> text)."""
    package = Path(values["package"])
    return {
        Path("kernel.yaml"): _manifest(values, wrapped),
        package / "__init__.py": _init(values, wrapped),
        package / "api.py": _api(values, wrapped),
        package / "benchmark.py": _benchmark(values, wrapped),
        Path("tests") / f"test_{values['package']}.py": _tests(values, wrapped),
    }


def table_orders(wrapped: WrappedFunction) -> dict[str, tuple[str, ...]]:
    return dict.fromkeys(wrapped.platforms, (IMPLEMENTATION,))


BASE_REQUIRES = {"jax": ">=0.7", "torch": ">=2.8"}


def _manifest(values: dict[str, str], wrapped: WrappedFunction) -> str:
    requires = {"kernel-hub": ">=1.5", **BASE_REQUIRES}  # kernel-hub: the kernel API version
    needs = (
        f"# {wrapped.module} comes from no installed distribution: it must be importable "
        "wherever this kernel loads\n"
    )
    if wrapped.requirement is not None:
        dist, version = wrapped.requirement
        requires[dist] = f">={version}"  # the version it was generated against
        needs = f"# {dist} provides {wrapped.module}, which the kernel calls\n"
    lines = "".join(f'  {dist}: "{spec}"\n' for dist, spec in requires.items())
    return (
        f"name: {values['kernel']}\n"
        "version: 1.0.0\n"
        f"package: {values['package']}\n"
        "summary: >-\n"
        f"  {values['summary']}\n"
        "license: Apache-2.0\n"
        f"ops: [{values['op']}]  # torch ops (derived from api.py's op declaration)\n"
        "layers: []    # layer classes for kernelize(), as KERNEL.layers names them\n"
        "implementations:\n"
        f"  {IMPLEMENTATION}: [{', '.join(wrapped.platforms)}]   # {wrapped.spec} itself\n"
        f"requires:\n{lines}{needs}"
    )


def _init(values: dict[str, str], wrapped: WrappedFunction) -> str:
    op = values["op"]
    return f'''"""A kernel-hub kernel wrapping ``{wrapped.spec}``: its torch op, ``jax`` (its JAX
API) and ``KERNEL``, everything kernel-hub reads from this package."""

from kernel_hub.kernel_api import KernelDeclaration

from . import api as jax
from . import benchmark

{op} = jax.{op}.torch

KERNEL = KernelDeclaration(
    ops={{"{op}": {op}}},
    jax=jax,
    implementation_tables=(jax.TABLE,),
    benchmark_cases=benchmark.CASES,
    torch_implementations=benchmark.TORCH_IMPLEMENTATIONS,
)
'''


def _call(wrapped: WrappedFunction, options: bool = True) -> str:
    """The wrapped function's call, arguments as it names them; without ``options`` it uses
    its own defaults (the generated tests' reference)."""
    args = [n if n not in wrapped.keyword_arrays else f"{n}={n}" for n in wrapped.arrays]
    args += [f"{o.name}={o.name}" for o in wrapped.options if options]
    return f"wrapped({', '.join(args)})"


def _api(values: dict[str, str], wrapped: WrappedFunction) -> str:
    op = values["op"]
    rule, whole = sharding_rule(wrapped, wrapped.spec)
    arrays = ", ".join(wrapped.arrays)
    checks = [f'check_rank(OP, "{n}", {n}, {len(s)})' for n, s in wrapped.shapes.items()]
    options = [f"{o.name}: {o.type_name} = {o.default!r}," for o in wrapped.options]
    keywords = ", ".join(f"{o.name}={o.name}" for o in wrapped.options)
    implementation_params = ", ".join(
        [*wrapped.arrays, *(["*"] if wrapped.options else []), *(o.name for o in wrapped.options)]
    )
    left = (
        f"\n\n    Left at the function's default (None): {', '.join(wrapped.left_at_default)}."
        if wrapped.left_at_default
        else ""
    )
    differentiable = () if wrapped.grad_problem else wrapped.arrays
    note = f"# No gradients: {wrapped.grad_problem}.\n" if wrapped.grad_problem else ""
    return f'''"""The op ``{wrapped.spec}``, declared once (written by ``kernel-hub new-kernel
--from-jax``): its typed JAX function behind kernel-hub's input checks, implementation table and
sharding rule, from which kernel-hub derives the torch op (``{op}.torch``).

Add implementations (a Pallas kernel, a plain jax.numpy reference) to ``TABLE``; the generated
tests compare the op with ``{wrapped.spec}`` itself.
"""

from __future__ import annotations

import jax
from {wrapped.module} import {wrapped.name} as wrapped

from kernel_hub.kernel_api import Einsum, Implementation, ImplementationTable, check_rank, op

OP = "{op}"


def check_inputs({arrays}) -> None:
    """The ranks of the example arrays the op was generated from (the sharding rule names each
    of their dimensions); shared by the JAX function and the torch op."""
{_indent(checks, 4)}


def _{IMPLEMENTATION}({implementation_params}):
    return {_call(wrapped)}


TABLE = ImplementationTable(
    OP,
    [Implementation("{IMPLEMENTATION}", _{IMPLEMENTATION}, {_py(wrapped.platforms)})],
    default_order={_py(table_orders(wrapped))},
)


# Every dimension whole: under a mesh the op runs on gathered inputs, replicated. Declare the
# dimensions that may be split (drop them from whole=) once the function is known to allow it.
{note}@op(
    check=check_inputs,
    differentiable={_py(differentiable)},
    sharding=Einsum("{rule}", whole={_py(whole)}),
)
def {op}(
{_indent([f"{n}: jax.Array," for n in wrapped.arrays], 4)}
    *,
{_indent(options, 4)}
    implementation: str | None = None,
) -> jax.Array:
    """``{wrapped.spec}`` as a kernel-hub op. ``implementation`` forces one; by default the
    platform's order (the registry's) is tried.{left}
    """
    return TABLE({arrays}, {keywords + ", " if keywords else ""}implementation=implementation)
'''


def _benchmark(values: dict[str, str], wrapped: WrappedFunction) -> str:
    op = values["op"]
    shapes = ",\n".join(
        f"        jax.ShapeDtypeStruct({s!r}, dtype)" for s in wrapped.shapes.values()
    )
    differentiable = () if wrapped.grad_problem else tuple(range(len(wrapped.arrays)))
    arrays = ", ".join(wrapped.arrays)
    return f'''"""The kernel's test data: the example call it was generated from, for ``kernel-hub
bench`` and the TPU compile matrix, and the torch paths timed beside it. Add representative
shapes."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from kernel_hub.kernel_api import CPU_TAG, KernelCase

from .api import {op}, wrapped


def case(name: str, dtype=jnp.float32, tags=()) -> KernelCase:
    args = (
{shapes},
    )
    result = jax.eval_shape(lambda {arrays}: {_call(wrapped, options=False)}, *args)
    return KernelCase(
        name=name,
        fn={op},
        args=args,
        flops=0,  # FLOPs per call: fill in (0 leaves the roofline columns empty)
        # each operand read once and the result written once: a lower bound
        bytes_accessed=sum(math.prod(a.shape) * a.dtype.itemsize for a in (*args, result)),
        differentiable={_py(differentiable)},
        tags=tuple(tags),
    )


CASES = [
    case("example-f32", tags=(CPU_TAG,)),
    case("example-bf16", jnp.bfloat16),
]


def kernel_hub_{op}({arrays}):
    """kernel-hub's torch op (bridge to JAX, the platform's default implementation)."""
    return {op}.torch({arrays})


# Torch callables taking a case's arguments as tensors and its kwargs.
TORCH_IMPLEMENTATIONS = {{"torch-op": kernel_hub_{op}}}
'''


def _tests(values: dict[str, str], wrapped: WrappedFunction) -> str:
    op, kernel = values["op"], values["kernel"]
    arrays = ", ".join(wrapped.arrays)
    draws = [
        f"torch.randn({s!r}, dtype=torch.float64 if x64 else torch.float32),"
        for s in wrapped.shapes.values()
    ]
    grad_test = (
        f"""


def test_gradients_match_the_function():
    args = inputs()
    want = jax.vjp(reference, *(jnp.asarray(a.numpy()) for a in args))
    cotangent = torch.randn(want[0].shape)
    leaves = [a.clone().requires_grad_() for a in args]
    k.{op}(*leaves).backward(cotangent)
    for got, expected in zip(leaves, want[1](jnp.asarray(cotangent.numpy())), strict=True):
        np.testing.assert_allclose(got.grad.numpy(), np.asarray(expected), rtol=1e-5, atol=1e-6)


def test_gradcheck_in_float64():
    leaves = [a.requires_grad_() for a in inputs(x64=True)]
    # fast mode: random directions, not one evaluation per input element
    assert torch.autograd.gradcheck(lambda *a: k.{op}(*a), leaves, fast_mode=True)"""
        if wrapped.grad_problem is None
        else f"\n\n\n# No gradient tests: {wrapped.grad_problem}."
    )
    first, rank = wrapped.arrays[0], len(wrapped.shapes[wrapped.arrays[0]])
    skip = ""
    if wrapped.lowering_problems:
        skip = f"""# Where the function does not lower these tests cannot run; kernel-hub
# compile-check compiles it for TPUs on any host.
WHY_NOT = {wrapped.lowering_problems!r}
pytestmark = pytest.mark.skipif(
    jax.default_backend() in WHY_NOT, reason=WHY_NOT.get(jax.default_backend(), "")
)
"""
    wrong_rank = f"torch.randn({(2,) * (rank + 1)!r})"
    return f'''"""{kernel} against the function it wraps, ``{wrapped.spec}``: the JAX API and the
torch op give its values and gradients (as generated, on its example shapes), the op passes
``opcheck``, and bad input is refused before it runs."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from {wrapped.module} import {wrapped.name} as wrapped

from kernel_hub import get_kernel
from kernel_hub.errors import KernelInputError

KERNEL_DIR = Path(__file__).resolve().parents[1]
# The kernel project's registry (kernels/{kernel}/ sits beside it), so the tests run from anywhere.
k = get_kernel("{kernel}", registry=KERNEL_DIR.parents[1] / "registry.yaml", local_dir=KERNEL_DIR)
{skip}

@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)


def inputs(x64: bool = False) -> list[torch.Tensor]:
    return [
{_indent(draws, 8)}
    ]


def reference({arrays}):
    """The wrapped function with its own defaults, which the op's options default to."""
    return {_call(wrapped, options=False)}


def test_jax_api_matches_the_function():
    args = [jnp.asarray(a.numpy()) for a in inputs()]
    np.testing.assert_allclose(k.jax.{op}(*args), reference(*args), rtol=1e-6, atol=1e-6)


def test_torch_op_matches_the_function():
    args = inputs()
    out = k.{op}(*args)
    want = np.asarray(reference(*(jnp.asarray(a.numpy()) for a in args)))
    assert out.shape == want.shape and str(out.dtype) == f"torch.{{want.dtype}}"
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-6, atol=1e-6){grad_test}


def test_opcheck():
    torch.library.opcheck(k.{op}.op, tuple(inputs()))


def test_a_wrong_rank_is_refused_before_the_function_runs():
    args = inputs()
    args[0] = {wrong_rank}
    with pytest.raises(KernelInputError, match="{first} must have rank {rank}"):
        k.{op}(*args)
'''
