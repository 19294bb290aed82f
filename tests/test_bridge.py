"""The torch -> JAX -> torch bridge: op contract (opcheck, gradcheck, torch.compile), input
layouts, scoped x64, row buckets, the DLPack paths, thread policy, compilation cache, lazy import.

Runs on the rmsnorm kernel's op and on small test-only ops defined here.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import pytest
import torch

from kernel_hub import get_kernel
from kernel_hub.bridge.runtimes import dlpack
from kernel_hub.bridge.runtimes.aot import compilations
from kernel_hub.bridge.runtimes.exchange import exchange_for
from kernel_hub.bridge.torch_op import RowBuckets, jax_op, power_of_two
from kernel_hub.dispatch import Implementation, ImplementationTable
from kernel_hub.errors import KernelInputError, UnknownNameError, UnsupportedDeviceError
from kernel_hub.sharding import ShardingRule, sharded

NS = "kernel_hub_bridge_test"

validations: list[tuple] = []


def _scale_rows(x, w, bias, *, shift):
    y = x * w + shift
    return y if bias is None else y + bias


@jax_op(NS, _scale_rows, differentiable=("x", "w"), buckets=RowBuckets(inputs=("x",)))
def scale_rows(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, shift: float = 0.0
) -> torch.Tensor:
    """``x * w + shift (+ bias)`` per row; its weight gradient sums over rows, so wrongly padded
    cotangents would show up in it."""
    validations.append((tuple(x.shape), x.dtype, shift))
    if tuple(w.shape) != (x.shape[-1],):
        raise KernelInputError(f"scale_rows: w must have shape ({x.shape[-1]},), got {w.shape}")


@jax_op(NS, lambda x: x)
def passthrough(x: torch.Tensor) -> torch.Tensor:
    """Returns its input: the bridge must still hand back a new buffer."""


@jax_op(NS, lambda x, *, dims: x.sum(axis=dims))
def sum_dims(x: torch.Tensor, dims: list[int]) -> torch.Tensor:
    """A list argument: static for JAX, so it must reach it hashable (as a tuple)."""


@pytest.fixture(scope="module")
def rmsnorm():
    return get_kernel("rmsnorm")


def rms_norm_reference(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.double()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def assert_close_to(actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    assert actual.shape == expected.shape
    error = (actual.double() - expected.double()).abs().max().item() if actual.numel() else 0.0
    assert error <= tol, f"max abs error {error:.3e} > {tol:.1e}"


# --- op contract -------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(8, 128), (3, 128), (2, 3, 128), (128,), (0, 128)])
def test_rmsnorm_values(rmsnorm, shape):
    x, w = torch.randn(shape), torch.randn(128)
    assert_close_to(rmsnorm.rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6), 2e-6)


def test_opcheck_rmsnorm(rmsnorm):
    x = torch.randn(3, 5, 32, requires_grad=True)
    w = torch.randn(32, requires_grad=True)
    torch.library.opcheck(rmsnorm.rms_norm.op, (x, w, 1e-5))
    torch.library.opcheck(rmsnorm.rms_norm.op, (x.detach(), w.detach(), 1e-5))


@pytest.mark.parametrize("with_bias", [False, True])
def test_opcheck_test_op(with_bias):
    x = torch.randn(5, 16, requires_grad=True)
    w = torch.randn(16, requires_grad=True)
    bias = torch.randn(16) if with_bias else None
    torch.library.opcheck(scale_rows.op, (x, w, bias, 0.5))
    torch.library.opcheck(passthrough.op, (torch.randn(4, 3),))


def test_gradcheck_f64_keeps_global_x64_off(rmsnorm):
    assert not jax.config.jax_enable_x64
    x = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(16, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: rmsnorm.rms_norm(x, w, 1e-6), (x, w))
    assert torch.autograd.gradcheck(lambda x, w: scale_rows(x, w, None, 0.25), (x, w))
    assert not jax.config.jax_enable_x64
    y = rmsnorm.rms_norm(x.detach(), w.detach(), 1e-6)
    assert y.dtype == torch.float64
    assert_close_to(y, rms_norm_reference(x, w, 1e-6), 1e-12)  # really f64, not a f32 round trip


class _Block(torch.nn.Module):
    def __init__(self, norm_op):
        super().__init__()
        self.norm_op = norm_op
        self.proj = torch.nn.Linear(32, 32)
        self.weight = torch.nn.Parameter(torch.randn(32))

    def forward(self, x):
        h = self.norm_op(self.proj(x), self.weight, 1e-6)
        return scale_rows(torch.relu(h), self.weight, None, 1.0).sum(-1)


def test_torch_compile_fullgraph_no_graph_breaks(rmsnorm):
    block = _Block(rmsnorm.rms_norm)
    x = torch.randn(2, 7, 32)
    # fullgraph=True: one graph; a graph break raises, naming its reason
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    out = compiled(x)
    assert_close_to(out, block(x), 1e-5)
    out.sum().backward()  # the backward op runs inside the compiled graph too
    grad = block.weight.grad.clone()
    block.weight.grad = None
    block(x).sum().backward()
    assert_close_to(grad, block.weight.grad, 1e-4)


def _frames_compiled(op, *args):
    """Frames torch.compile compiles for a model whose eager part calls ``op`` (an OpOverload)
    from C++ while dynamo's frame hook is active, i.e. where it would trace our kernels."""
    from torch._dynamo.utils import counters

    @torch._dynamo.disable(recursive=False)
    def eager_part(*args):
        return op(*args)

    def model(*args):
        return eager_part(*args) + 1

    torch._dynamo.reset()
    counters.clear()
    torch.compile(model, backend="eager")(*args)
    return counters["frames"]["total"]


def test_kernels_are_never_traced_by_dynamo(rmsnorm):
    x, w = torch.randn(4, 8), torch.randn(8)
    baseline = _frames_compiled(torch.ops.aten.mul.Tensor, x, w)
    assert _frames_compiled(rmsnorm.rms_norm.op, x, w, 1e-6) == baseline


def test_traced_and_fake_calls_reach_the_dispatcher(rmsnorm):
    """The autograd kernel's shortcut (straight to the implementation) must not skip tracing."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    graph = make_fx(lambda x, w: rmsnorm.rms_norm(x, w, 1e-6))(torch.randn(4, 8), torch.randn(8))
    assert [n.target for n in graph.graph.nodes if n.op == "call_function"] == [rmsnorm.rms_norm.op]
    with FakeTensorMode():
        out = rmsnorm.rms_norm(torch.randn(2, 3, 8), torch.randn(8))
    assert out.shape == (2, 3, 8) and type(out).__name__ == "FakeTensor"


def test_direct_calls_only_when_the_dispatcher_would_make_them(monkeypatch):
    """Plain eager calls skip the dispatcher; modes, profilers, subclasses, gradients don't."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from kernel_hub.bridge.eager import DirectCalls

    def stub(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6, k: int = 0) -> None: ...

    direct = DirectCalls(inspect.signature(stub), ("x", "w"))
    x, w = torch.randn(4, 8), torch.nn.Parameter(torch.randn(8))
    frozen = torch.nn.Parameter(torch.randn(8), requires_grad=False)
    assert direct.allowed((x, frozen, 1e-6))
    assert direct.positional((x, frozen), {"k": 2}) == (x, frozen, 1e-6, 2)
    assert direct.positional((x,), {"w": frozen}) == (x, frozen, 1e-6, 0)
    assert direct.positional((x, frozen), {"x": x}) is None  # given twice: the dispatcher says so
    assert direct.positional((x,), {"eps": 1e-6}) is None  # w missing
    assert direct.positional((x, frozen), {"bogus": 1}) is None
    assert not direct.allowed((x, frozen, torch.tensor(1e-6)))  # a tensor for a float
    assert not direct.allowed((x, x.to("meta")[0]))
    assert not direct.allowed((x, w))  # w needs a gradient
    with torch.no_grad():
        assert direct.allowed((x, w))
    with torch.inference_mode():
        assert direct.allowed((x, frozen))
    fake_x = FakeTensorMode().from_tensor(x)
    assert not direct.allowed((fake_x, frozen))  # a tensor subclass

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Recorder():
        assert not direct.allowed((x, frozen))
    with torch.profiler.profile():
        assert not direct.allowed((x, frozen))
    monkeypatch.setenv("KERNEL_HUB_DIRECT_CALLS", "0")
    assert not DirectCalls(inspect.signature(stub), ("x", "w")).allowed((x, frozen))


def test_direct_call_keys_tell_apart_what_a_bound_call_depends_on():
    """Two calls share a cached direct call only if every tensor's class, shape, dtype, device
    and (in grad mode) requires_grad, the grad mode, every other argument and the type of int
    arguments agree; arguments that cannot key one (a non-tensor or None where a tensor must
    go, too many) give no key. Tensors need not lead the parameters."""
    from kernel_hub.bridge.eager import DirectCalls

    def stub(
        k: int, x: torch.Tensor, bias: torch.Tensor | None = None, dims: list[int] = (0,)
    ) -> None: ...

    direct = DirectCalls(inspect.signature(stub, eval_str=True), ("x", "bias"), list_static=True)
    x, b = torch.randn(4, 8), torch.randn(8)
    key = direct.key
    assert key((2, x)) == key((2, torch.randn(4, 8))) is not None
    assert key((2, x, b, [0, 1])) == key((2, x, torch.randn(8), (0, 1)))  # lists key as tuples
    different = [
        (2, x, b),
        (2, x, None, [0]),  # defaults given: another key (the dispatcher may leave them out)
        (2.0, x),  # 2.0 == 2, but an int parameter refuses it
        (True, x),
        (3, x),
        (2, x.double()),
        (2, x[:2]),
        (2, x.to("meta")),
        (2, torch.nn.Parameter(x, requires_grad=False)),
    ]
    keys = [key((2, x)), *map(key, different)]
    assert None not in keys and len(set(keys)) == len(keys)
    wants_grad = x.clone().requires_grad_()
    assert key((2, wants_grad)) != key((2, x))
    with torch.no_grad():
        assert key((2, wants_grad)) == key((2, x)) != keys[0]  # grad mode is keyed too
    assert key((2, 3.0)) is None and key((2, None)) is None  # a tensor must go there
    assert key((2, x, b, [0], "extra")) is None and key((2,)) is None


def test_in_place_data_writes_to_a_plain_weight_are_seen(rmsnorm):
    """A cached direct call copies a small plain tensor in on every call: writes through
    ``.data`` (which bumps no version counter) reach the next call."""
    x, w = torch.randn(4, 16), torch.randn(16)
    with torch.no_grad():
        for _ in range(2):
            first = rmsnorm.rms_norm(x, w, 1e-6)
        w.data.mul_(3.0)
        assert_close_to(rmsnorm.rms_norm(x, w, 1e-6), first * 3.0, 1e-5)


def test_modes_and_profilers_still_see_the_op(rmsnorm):
    from torch.utils._python_dispatch import TorchDispatchMode

    x, w = torch.randn(4, 8), torch.randn(8)
    seen = []

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Recorder():
        direct = rmsnorm.rms_norm(x, w, 1e-6)
    assert rmsnorm.rms_norm.op in seen
    with torch.profiler.profile() as profile:
        rmsnorm.rms_norm(x, w, 1e-6)
    assert any(event.name == rmsnorm.rms_norm.qualname for event in profile.events())
    assert torch.equal(direct, rmsnorm.rms_norm(x, w, 1e-6))
    # A 0-d tensor for a float goes through the dispatcher, which converts it.
    assert torch.equal(direct, rmsnorm.rms_norm(x, w, torch.tensor(1e-6)))


# --- input layouts -----------------------------------------------------------------------------


def _layouts():
    base = torch.randn(16, 64)
    flat = torch.randn(16 * 64 + 1)
    return {
        "transposed": torch.randn(64, 16).T,
        "strided": torch.randn(16, 128)[:, ::2],
        "misaligned": flat[1:].view(16, 64),  # storage offset of 4 bytes
        "expanded": torch.randn(1, 64).expand(16, 64),
        "contiguous": base,
    }


LAYOUTS = ("transposed", "strided", "misaligned", "expanded", "contiguous")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_input_layouts(rmsnorm, layout):
    x = _layouts()[layout]
    w = torch.randn(64)
    assert_close_to(rmsnorm.rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6), 2e-6)
    assert_close_to(scale_rows(x, w, None, 0.0), x * w, 0.0)


def test_requires_grad_inputs(rmsnorm):
    x = torch.randn(4, 32, requires_grad=True)
    w = torch.randn(32, requires_grad=True)
    with torch.no_grad():
        assert not rmsnorm.rms_norm(x, w).requires_grad
    y = rmsnorm.rms_norm(x, w)
    assert y.requires_grad
    y.pow(2).sum().backward()
    xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    rms_norm_reference(xr, wr, 1e-6).pow(2).sum().backward()
    assert_close_to(x.grad, xr.grad, 1e-4)
    assert_close_to(w.grad, wr.grad, 1e-4)


def test_output_is_a_new_buffer():
    x = torch.randn(4, 3)
    y = passthrough(x)
    assert torch.equal(x, y)
    assert y.data_ptr() != x.data_ptr()
    y.add_(1.0)
    assert not torch.equal(x, y)


def test_list_arguments_are_static():
    x = torch.randn(2, 3, 4)
    assert_close_to(sum_dims(x, [0, 2]), x.sum((0, 2)), 1e-5)
    assert_close_to(sum_dims(x, [1]), x.sum(1), 1e-5)
    torch.library.opcheck(sum_dims.op, (x, [0, 2]))


def test_stub_definition_errors():
    with pytest.raises(TypeError, match="keyword-only"):

        @jax_op(NS, lambda x, *, k: x)
        def kw_only(x: torch.Tensor, *, k: int = 1) -> torch.Tensor: ...

    with pytest.raises(TypeError, match="non-tensor"):
        jax_op(NS, lambda x: x, differentiable=("k",))(lambda x, k: x)
    with pytest.raises(TypeError, match="buckets name non-tensor"):

        @jax_op(NS, lambda x, *, k: x, buckets=RowBuckets(inputs=("k",)))
        def bucket_static(x: torch.Tensor, k: int = 1) -> torch.Tensor: ...

    with pytest.raises(TypeError, match="frozen names"):  # a differentiable one: not frozen

        @jax_op(NS, lambda x, w: x * w, differentiable=("x", "w"), frozen=("w",))
        def frozen_but_differentiable(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor: ...


@pytest.mark.parametrize(
    ("jax_fn", "problem"),
    [
        (
            lambda w, x, *, shift: x,
            r"first parameters are \(w, x\), the stub's tensor arguments \(x, w\)",
        ),
        (lambda x, w: x, "the JAX function takes no keyword shift"),
        (lambda x, w, *, shift, scale: x, "the JAX function requires scale, which the stub lacks"),
        (
            sharded(ShardingRule.parse("op", "rows cols -> rows cols"))(lambda x, w, *, shift: x),
            r"sharding rule 'op' \(rows cols -> rows cols\) has 1 operands, the stub 2 tensor",
        ),
    ],
)
def test_stub_and_jax_function_contract_checked_by_name_at_definition(jax_fn, problem):
    """The bridge calls the JAX function with the stub's tensors positionally and the rest by
    keyword: a stub naming them otherwise is an error when the op is defined."""
    with pytest.raises(
        TypeError, match="contract_stub: the stub and its JAX function disagree: .*" + problem
    ):

        @jax_op(NS, jax_fn)
        def contract_stub(x: torch.Tensor, w: torch.Tensor, shift: float = 0.0) -> torch.Tensor: ...


def test_keyword_calls_take_the_eager_fast_path(rmsnorm, monkeypatch):
    """Static arguments given by keyword are as direct as positional ones (no dispatcher)."""
    x, w = torch.randn(4, 32), torch.randn(32)
    want = rmsnorm.rms_norm(x, w, 1e-6, None, 1.0, "input")
    dispatched = []
    op = rmsnorm.rms_norm.op
    monkeypatch.setattr(rmsnorm.rms_norm, "op", lambda *a, **k: dispatched.append(a) or op(*a, **k))
    for _ in range(2):  # the first call binds the direct call, the second reuses it
        got = rmsnorm.rms_norm(x, w, weight_offset=1.0, rounding="input")
        torch.testing.assert_close(got, want)
        # a tensor by keyword: direct too, in its place
        torch.testing.assert_close(rmsnorm.rms_norm(x, weight=w, eps=1e-6), rmsnorm.rms_norm(x, w))
    assert dispatched == []
    with pytest.raises(RuntimeError, match="Unknown keyword argument 'bogus'"):
        rmsnorm.rms_norm(x, w, bogus=1.0)  # the dispatcher's error, as before
    assert len(dispatched) == 1


_ORDER_TABLE = ImplementationTable(
    "test_order_op",
    [
        Implementation("double", lambda x: x * 2, ("cpu",)),
        Implementation("triple", lambda x: x * 3, ("cpu",)),
    ],
    default_order={"cpu": ("double", "triple")},
)


@jax_op(NS, lambda x: _ORDER_TABLE(x))
def ordered(x: torch.Tensor) -> torch.Tensor: ...


def test_cached_direct_calls_follow_implementation_order_changes():
    """A plain eager call reuses its bound executable until an implementation order changes."""
    x = torch.ones(2, 3)
    with torch.no_grad():
        assert torch.equal(ordered(x), x * 2) and torch.equal(ordered(x), x * 2)
        try:
            _ORDER_TABLE.set_order("cpu", ("triple", "double"))
            assert torch.equal(ordered(x), x * 3) and torch.equal(ordered(x), x * 3)
        finally:
            _ORDER_TABLE.set_order("cpu", ("double", "triple"))
        assert torch.equal(ordered(x), x * 2)


_TRACED: list[str] = []  # which inner implementation each trace of ``nested`` picked


def _traced(name: str, add: int):
    return lambda x: _TRACED.append(name) or x + add


_INNER_TABLE = ImplementationTable(
    "test_inner_op",
    [
        Implementation("plus_one", _traced("plus_one", 1), ("cpu",)),
        Implementation("plus_two", _traced("plus_two", 2), ("cpu",)),
    ],
    default_order={"cpu": ("plus_one", "plus_two")},
)
_OUTER_TABLE = ImplementationTable(
    "test_outer_op",
    [Implementation("scaled", lambda x: _INNER_TABLE(x) * 10, ("cpu",))],
    default_order={"cpu": ("scaled",)},
)


@jax_op(NS, lambda x: _OUTER_TABLE(x))
def nested(x: torch.Tensor) -> torch.Tensor: ...


def test_only_an_order_a_trace_consulted_invalidates_its_program():
    """A table made and ordered after a program was traced (a kernel loaded later) leaves the
    program compiled; a new order of a table the trace consulted, nested in another table's
    implementation, traces it again with the new choice."""
    x = torch.ones(2, 3)
    with torch.no_grad():
        assert torch.equal(nested(x), x * 20)
        assert _TRACED[-1] == "plus_one"
        traced = len(_TRACED)
        loaded = ImplementationTable(
            "test_loaded_op",
            [Implementation(n, lambda x: x, ("cpu",)) for n in ("a", "b")],
            default_order={"cpu": ("a", "b")},
        )
        loaded.set_order("cpu", ("b", "a"))  # as the registry does on a kernel's load
        assert torch.equal(nested(x), x * 20)
        assert len(_TRACED) == traced, "an unrelated kernel's load made the program trace again"
        try:
            _INNER_TABLE.set_order("cpu", ("plus_two", "plus_one"))
            assert torch.equal(nested(x), x * 30)
            assert _TRACED[traced:] == ["plus_two"]
        finally:
            _INNER_TABLE.set_order("cpu", ("plus_one", "plus_two"))
        assert torch.equal(nested(x), x * 20)


def test_cached_direct_calls_keep_their_guards(rmsnorm):
    """What a cached call was bound for: another dtype, a fake tensor, a gradient or a mode
    after it misses the cache and gets its own checks."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x, w = torch.randn(4, 16), torch.randn(16)
    rms = rmsnorm.rms_norm
    for _ in range(2):
        assert_close_to(rms(x, w, 1e-6), rms_norm_reference(x, w, 1e-6), 2e-6)
    with pytest.raises(KernelInputError, match="weight"):
        rms(x, torch.randn(15), 1e-6)  # another shape: validated, not the cached call
    assert rms(x.double(), w.double(), 1e-6).dtype == torch.float64
    with FakeTensorMode() as mode:
        assert type(rms(mode.from_tensor(x), mode.from_tensor(w), 1e-6)).__name__ == "FakeTensor"
    wants_grad = w.clone().requires_grad_()
    assert rms(x, wants_grad, 1e-6).requires_grad
    with torch.no_grad():
        assert not rms(x, wants_grad, 1e-6).requires_grad


def test_fast_call_is_the_compiled_executables_cpp_dispatcher():
    """The DLPack runtime calls executables through JAX's C++ dispatcher (see ``fast_call``);
    on this JAX it exists and gives the executable's results."""
    from kernel_hub.bridge.runtimes.aot import fast_call

    compiled = jax.jit(lambda a: a * 2 + 1).lower(jax.numpy.ones(3)).compile()
    call = fast_call(compiled)
    assert call is not compiled
    assert jax.numpy.array_equal(call(jax.numpy.arange(3.0)), compiled(jax.numpy.arange(3.0)))


def test_validation_once_per_signature_and_errors_not_cached():
    x, w = torch.randn(6, 24), torch.randn(24)
    before = len(validations)
    for _ in range(3):
        scale_rows(x, w, None, 0.125)
    assert len(validations) == before + 1
    for _ in range(2):
        with pytest.raises(KernelInputError, match=r"w must have shape \(24,\)"):
            scale_rows(x, torch.randn(5), None, 0.125)


def test_mixed_devices_rejected():
    with pytest.raises(UnsupportedDeviceError, match="one device"):
        scale_rows(torch.randn(2, 3), torch.randn(3, device="meta"))


# --- row buckets -------------------------------------------------------------------------------


def test_power_of_two():
    assert [power_of_two(n) for n in (0, 1, 2, 3, 5, 8, 9, 1000)] == [0, 1, 2, 4, 8, 8, 16, 1024]


def test_bucket_layout():
    buckets = RowBuckets(inputs=("x",))
    assert buckets.layout({"x": torch.empty(8, 4)}) is None  # already a bucket: nothing to do
    layout = buckets.layout({"x": torch.empty(2, 3, 4)})
    assert (layout.lead, layout.rows, layout.padded) == ((2, 3), 6, 8)
    both = RowBuckets(inputs=("x", "y"))
    assert both.layout({"x": torch.empty(3, 4), "y": torch.empty(5, 4)}) is None  # disagree
    with pytest.raises(ValueError, match="at least one input"):
        RowBuckets(inputs=())


def test_buckets_share_one_compilation_per_role():
    w = torch.randn(40)
    scale_rows(torch.randn(9, 40), w, None, 2.0)  # 16-row bucket
    before = compilations()
    for rows in (10, 13, 16):
        x = torch.randn(rows, 40)
        assert_close_to(scale_rows(x, w, None, 2.0), x * w + 2.0, 1e-6)
    x = torch.randn(2, 5, 40)  # 10 rows in two leading dims
    assert_close_to(scale_rows(x, w, None, 2.0), x * w + 2.0, 1e-6)
    assert compilations() == before


def test_sixty_four_lengths_compile_seven_buckets():
    w = torch.randn(56)
    before = compilations()
    for rows in range(1, 65):
        scale_rows(torch.randn(1, rows, 56), w, None, 0.0)
    assert compilations() - before == 7  # 1, 2, 4, ..., 64 rows


@pytest.mark.parametrize("rows", [3, 5, 11])
def test_bucketed_gradients(rows):
    x = torch.randn(rows, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(8, dtype=torch.float64)
    g = torch.randn(rows, 8, dtype=torch.float64)
    scale_rows(x, w, bias, 0.5).backward(g)
    assert_close_to(w.grad, (g * x).sum(0), 1e-12)  # padded rows add nothing
    assert_close_to(x.grad, g * w, 1e-12)
    assert x.grad.shape == x.shape


@pytest.mark.parametrize("shape", [(3, 5, 8), (4, 8), (5, 8)], ids=["lead-dims", "exact", "padded"])
def test_outputs_may_be_modified_in_place_before_backward(shape):
    """As with a stock op, the caller may scale an output in place (XLM: ``tensor *= mask``) and
    still get the gradients: the derived backward saves no output, and an output that is a view
    (padded rows cut, leading dimensions restored) is returned detached."""
    x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, dtype=torch.float64, requires_grad=True)
    mask = (torch.arange(shape[-2]) % 2).to(torch.float64)[:, None]
    grads = []
    for fn in (scale_rows, lambda x, w, bias, shift: x * w + shift):
        x.grad = w.grad = None
        y = fn(x, w, None, 0.5)
        y *= mask
        y.square().sum().backward()
        grads.append((y.detach(), x.grad, w.grad))
    for got, want in zip(*grads, strict=True):
        assert_close_to(got, want, 1e-12)


def test_bucketed_rmsnorm_gradients_with_zero_eps(rmsnorm):
    """Filler rows repeat a real row: with eps=0 zero filler rows would give NaN in dweight."""
    x = torch.randn(2, 3, 16, dtype=torch.float64, requires_grad=True)  # 6 rows -> bucket 8
    w = torch.randn(16, dtype=torch.float64, requires_grad=True)
    rmsnorm.rms_norm(x, w, 0.0).sum().backward()
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    rms_norm_reference(xr, wr, 0.0).sum().backward()
    assert_close_to(x.grad, xr.grad, 1e-10)
    assert_close_to(w.grad, wr.grad, 1e-10)


# --- DLPack exchange ---------------------------------------------------------------------------


def test_internal_exchange_used_on_cpu():
    assert exchange_for("cpu", jax.devices("cpu")[0]).name == "internal"


def test_public_exchange_gives_same_results(monkeypatch, rmsnorm):
    monkeypatch.setenv("KERNEL_HUB_DLPACK", "public")
    runtime = dlpack.DLPackRuntime()
    fn = jax.jit(lambda x, w: rmsnorm.jax.rms_norm(x, w, 1e-6))
    for dtype, tol in ((torch.float32, 2e-6), (torch.float64, 1e-12)):
        w = torch.randn(16, dtype=dtype)
        for x in (torch.randn(4, 16, dtype=dtype), torch.randn(65, dtype=dtype)[1:].view(4, 16)):
            out = runtime.call(fn, [x, w], key="public")
            assert out.dtype == dtype
            assert_close_to(out, rms_norm_reference(x, w, 1e-6), tol)
    assert runtime._routes[torch.device("cpu")][0].name == "public"


def test_parameter_arrays_follow_updates(rmsnorm):
    """Reused weight arrays see in-place updates and replaced storage, and die with the weight."""
    import gc
    import weakref

    x = torch.randn(4, 16)
    weight = torch.nn.Parameter(torch.randn(16))
    with torch.no_grad():
        rmsnorm.rms_norm(x, weight, 1e-6)
        weight.mul_(3.0)  # optimizer-style in-place step
        expected = rms_norm_reference(x, weight, 1e-6)
        assert_close_to(rmsnorm.rms_norm(x, weight, 1e-6), expected, 2e-6)
        weight.data = torch.randn(16)  # new storage
        expected = rms_norm_reference(x, weight, 1e-6)
        assert_close_to(rmsnorm.rms_norm(x, weight, 1e-6), expected, 2e-6)
    alive = weakref.ref(weight)
    del weight
    gc.collect()
    assert alive() is None  # the bridge keeps no reference to the parameter


# --- process-level settings (fresh interpreters) -----------------------------------------------

_CHILD = textwrap.dedent(
    """
    import json, os, sys
    import kernel_hub
    report = {"jax_at_import": "jax" in sys.modules, "torch_at_import": "torch" in sys.modules}
    import jax, jax.numpy as jnp, torch
    from kernel_hub.bridge.compile_cache import compilation_cache_dir
    # Any compile that reaches a persistent cache now writes to it, however fast it was.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    events = []
    jax.monitoring.register_event_listener(lambda e, **_: events.append(e))
    cache = compilation_cache_dir()
    files = lambda: sum(len(names) for _, _, names in os.walk(cache)) if cache else 0
    k = kernel_hub.get_kernel("rmsnorm")
    report["async_before_call"] = jax.config.read("jax_cpu_enable_async_dispatch")
    k.rms_norm(torch.randn(5, 48), torch.randn(48), 1e-6)
    report["async_after_call"] = jax.config.read("jax_cpu_enable_async_dispatch")
    report["cache_hits"] = events.count("/jax/compilation_cache/cache_hits")
    report["files_after_call"] = files()
    jax.jit(lambda a: a * 3 + 1)(jnp.ones(7)).block_until_ready()  # the user's own compiles
    report["files_after_user_jit"] = files()
    if "--deviceless" in sys.argv:
        from jax.sharding import SingleDeviceSharding
        from kernel_hub.topologies import tpu_device
        sharding = SingleDeviceSharding(tpu_device("v5e"))
        struct = jax.ShapeDtypeStruct((8, 128), jnp.float32, sharding=sharding)
        jax.jit(lambda a: a * 2).trace(struct).lower().compile()
        report["files_after_tpu_compile"] = files()
    print(json.dumps(report))
    """
)


def run_child(tmp_path: Path, *args: str, **env: str) -> dict:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("KERNEL_HUB_")}
    environment.update(XDG_CACHE_HOME=str(tmp_path / "xdg"), **env)
    done = subprocess.run(
        [sys.executable, "-P", "-c", _CHILD, *args],
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _cache_files(directory: Path) -> list[Path]:
    return [p for p in directory.rglob("*") if p.is_file()] if directory.exists() else []


def test_fresh_process_defaults(tmp_path):
    """Lazy import, inline thread policy applied at the first call, cache in the per-user dir
    that only the bridge's compiles use."""
    first = run_child(tmp_path)
    assert not first["jax_at_import"] and not first["torch_at_import"]
    assert first["async_before_call"] is True  # nothing changed by import or get_kernel
    assert first["async_after_call"] is False
    assert first["cache_hits"] == 0
    written = _cache_files(tmp_path / "xdg" / "kernel-hub" / "jax")
    assert len(written) == first["files_after_call"] == 1
    assert first["files_after_user_jit"] == 1  # the user's compiles stay out of it
    second = run_child(tmp_path)
    assert second["cache_hits"] == 1 and second["files_after_call"] == 1


_DTENSOR_LATER = textwrap.dedent(
    """
    import sys
    import torch
    import kernel_hub
    rms = kernel_hub.get_kernel("rmsnorm").rms_norm
    assert "torch.distributed.tensor" not in sys.modules, "loading a kernel imported DTensor"
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    x, w = torch.randn(4, 8, 32), torch.randn(32)
    dw = distribute_tensor(w, mesh, [Replicate()])
    out = rms(distribute_tensor(x, mesh, [Shard(1)]), dw, 1e-6)
    assert isinstance(out, DTensor) and out.placements == (Shard(1),), out
    torch.testing.assert_close(out.full_tensor(), rms(x, w, 1e-6))
    dist.destroy_process_group()
    """
)


@pytest.mark.slow
def test_dtensor_strategies_registered_when_dtensor_is_imported_after_the_kernel():
    """Loading a kernel does not import torch.distributed.tensor (and sympy with it); an op's
    DTensor strategy is registered when someone imports it."""
    done = subprocess.run(
        [sys.executable, "-P", "-c", _DTENSOR_LATER],
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.slow
def test_fresh_process_switches(tmp_path):
    custom = tmp_path / "custom"
    moved = run_child(tmp_path, KERNEL_HUB_COMPILATION_CACHE_DIR=str(custom))
    assert moved["files_after_call"] == 1 and len(_cache_files(custom)) == 1
    off = run_child(tmp_path, KERNEL_HUB_COMPILATION_CACHE="0", KERNEL_HUB_THREADS="default")
    assert off["cache_hits"] == 0 and off["files_after_call"] == 0
    assert not _cache_files(tmp_path / "xdg")
    assert off["async_after_call"] is True


@pytest.mark.slow
@pytest.mark.tpu_compile
def test_deviceless_tpu_compiles_never_reach_the_cache(tmp_path):
    report = run_child(tmp_path, "--deviceless")
    assert report["files_after_call"] == 1
    assert report["files_after_tpu_compile"] == 1


def test_thread_policy_names(monkeypatch):
    from kernel_hub.bridge import threads

    monkeypatch.setenv("KERNEL_HUB_THREADS", "inlined")
    with pytest.raises(UnknownNameError, match="inline"):
        threads.thread_policy()
    with pytest.raises(UnknownNameError, match="Valid"):
        threads.set_thread_policy("fast")
    monkeypatch.setenv("KERNEL_HUB_THREADS", "Default")
    assert threads.thread_policy() == "default"
