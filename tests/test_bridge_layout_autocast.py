"""Bridge contracts for torch.compile and autocast, on a toy op: fakes (forward and backward) have
the real outputs' layout, an optional differentiable input gets a gradient only when given, and
an op's autocast policy casts exactly the inputs it names, eager fast path included."""

from __future__ import annotations

import torch

from kernel_hub.bridge.torch_op import jax_op

NS = "kernel_hub_bridge_autocast_test"


def _gated(x, w, gate):
    y = x * w
    return y if gate is None else y * (1 + gate)


@jax_op(NS, _gated, differentiable=("x", "w", "gate"), autocast=("x", "w"))
def gated(x: torch.Tensor, w: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
    """``x * w`` (times ``1 + gate`` per column, promoting); x and w follow autocast, gate keeps
    its dtype."""


def _reference(x, w, gate):
    y = x * w
    return y if gate is None else y * (1 + gate)


def test_optional_differentiable_input_gets_a_gradient_only_when_given():
    x = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(4, requires_grad=True)
    gate = torch.randn(4, requires_grad=True)
    for given in (None, gate):
        got = torch.autograd.grad(gated(x, w, given).square().sum(), [x, w], retain_graph=True)
        want = torch.autograd.grad(_reference(x, w, given).square().sum(), [x, w])
        for g, r in zip(got, want, strict=True):
            assert torch.allclose(g, r, atol=1e-6)
    (d_gate,) = torch.autograd.grad(gated(x, w, gate).sum(), [gate])
    assert torch.allclose(d_gate, (x * w).sum(0), atol=1e-5)


def test_compiled_backward_of_a_transposed_input_views_like_eager():
    """The op gets a transposed view of a viewed leaf, as Transformers passes q/k/v: autograd
    views the op's gradient back, which a fake claiming the input's (transposed) strides would
    allow in the compiled graph and the real, contiguous gradient would not."""
    base = torch.randn(12, requires_grad=True)
    w = torch.randn(4)

    def step(base):
        return gated(base.view(4, 3).t(), w).square().sum()

    want = torch.autograd.grad(step(base), [base])[0]
    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    got = torch.autograd.grad(compiled(base), [base])[0]
    assert torch.allclose(got, want, atol=1e-6)


def test_autocast_casts_the_named_inputs_only():
    x = torch.randn(3, 4)
    w = torch.randn(4).bfloat16()
    gate = torch.randn(4)
    assert gated(x, w).dtype == torch.float32  # no autocast: JAX promotes f32 * bf16 to f32
    with torch.autocast("cpu", torch.bfloat16):
        eager = gated(x, w)  # plain eager call: the fast path must not skip autocast
        with_gate = gated(x, w, gate)
        compiled = torch.compile(lambda x, w: gated(x, w), backend="aot_eager", fullgraph=True)
        traced = compiled(x, w)
    assert eager.dtype == traced.dtype == torch.bfloat16
    # gate stayed f32, so the product promotes back to f32: it was not cast.
    assert with_gate.dtype == torch.float32
    want = (x.bfloat16() * w).float()
    assert torch.allclose(eager.float(), want) and torch.allclose(traced.float(), want)


def test_row_major_restrides_size_one_dims_without_copying():
    """torch calls a decode step's transposed q contiguous; JAX would read its size-1 dim's
    stride as another layout. The runtime hands JAX the same memory with row-major strides."""
    from kernel_hub.bridge.runtimes.dlpack import row_major

    q = torch.randn(2, 1, 4, 16).transpose(1, 2)  # [2, 4, 1, 16], strides (64, 16, 64, 1)
    assert q.is_contiguous() and q.stride() != (64, 16, 16, 1)
    fixed = row_major(q)
    assert fixed.stride() == (64, 16, 16, 1) and fixed.data_ptr() == q.data_ptr()
    assert torch.equal(fixed, q)
    plain = torch.randn(3, 4)
    assert row_major(plain) is plain
    assert row_major(plain.t()).stride() == (3, 1)  # non-contiguous: copied
