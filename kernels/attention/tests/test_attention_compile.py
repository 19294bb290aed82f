"""The torch ops under torch.compile and autocast: fakes report the layout the real ops return
(forward and backward), so a fullgraph ``aot_eager`` training step on transposed q/k/v views (as
Transformers passes them) gives eager's gradients; under autocast q/k/v run in its dtype."""

from __future__ import annotations

import sys

import pytest
import torch

from kernel_hub.errors import KernelInputError


def _projections(seed=0):
    """Hidden states and a projection whose output is viewed as [B, S, H, D] and transposed."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, 6, 32, generator=generator)
    weight = torch.randn(32, 64, generator=generator).mul_(0.2).requires_grad_()
    sinks = torch.randn(4, generator=generator).mul_(3).requires_grad_()
    bias = torch.randn(1, 4, 6, 6, generator=generator).requires_grad_()
    return hidden, weight, sinks, bias


def _step(attention, op_name):
    def step(hidden, weight, sinks, bias):
        h = hidden @ weight
        q = h[..., :32].view(2, 6, 4, 8).transpose(1, 2)
        k = h[..., 32:48].view(2, 6, 2, 8).transpose(1, 2)
        v = h[..., 48:].view(2, 6, 2, 8).transpose(1, 2)
        if op_name == "attention_with_lse":
            out, lse = attention.attention_with_lse(q, k, v, causal=True, sinks=sinks)
        elif op_name == "dropout":  # the integrations' call: a seed from torch's generator
            seed = sys.modules[f"{attention.__name__}.torch_api"].dropout_seed(q.device)
            out, lse = attention.attention_with_lse(
                q, k, v, causal=True, sinks=sinks, dropout_seed=seed, dropout_rate=0.3
            )
        else:
            mask = torch.ones(6, 6, dtype=torch.bool).tril()[None, None]
            out, lse = attention.attention_with_dense_mask(
                q, k, v, mask, causal=True, sinks=sinks, bias=bias
            )
        # The backward views the gradient of q back to [B, S, H * D], as Transformers does.
        return out.transpose(1, 2).reshape(2, 6, 32).square().sum() + lse.sum()

    return step


@pytest.mark.parametrize("op_name", ["attention_with_lse", "attention_with_dense_mask", "dropout"])
def test_fullgraph_aot_eager_training_step_on_transposed_inputs(attention, op_name):
    """With dropout the seed is drawn inside the graph: ``torch.manual_seed`` gives compiled and
    eager the same one."""
    step = _step(attention, op_name)
    hidden, *params = _projections()
    torch.manual_seed(0)
    want_loss = step(hidden, *params)
    want = torch.autograd.grad(want_loss, params, allow_unused=True)
    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    torch.manual_seed(0)
    got_loss = compiled(hidden, *params)
    got = torch.autograd.grad(got_loss, params, allow_unused=True)
    assert abs(got_loss.item() - want_loss.item()) <= 1e-5
    for name, g, w in zip(("weight", "sinks", "bias"), got, want, strict=True):
        if w is None:
            assert g is None, name
            continue
        assert (g - w).abs().max() <= 1e-5, f"{op_name} d{name}"


def test_backward_fake_has_the_real_gradient_layout(attention):
    """The backward op's fake gradients: shape, dtype and strides of the real ones, for
    transposed inputs whose strides differ from contiguous ones."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    q = torch.randn(1, 6, 4, 8).transpose(1, 2)
    k = torch.randn(1, 6, 2, 8).transpose(1, 2)
    v = torch.randn(1, 6, 2, 12).transpose(1, 2)
    sinks = torch.randn(4, dtype=torch.float64)
    op = attention.attention_with_lse
    out, lse = op(q, k, v, causal=True, sinks=sinks.float())
    inputs = [q, k, v, None, None, None, sinks.float(), None, None, None, None, None]
    static = (True, None, None, None, None, None, None, False, 0.0)
    real = op.backward_op(inputs, [out, lse], [torch.ones_like(out), torch.ones_like(lse)], *static)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake_inputs = [None if t is None else mode.from_tensor(t) for t in inputs]
        fake_out, fake_lse = mode.from_tensor(out), mode.from_tensor(lse)
        fake = op.backward_op(fake_inputs, [fake_out, fake_lse], [fake_out, fake_lse], *static)
    assert len(real) == len(fake) == 4
    for r, f in zip(real, fake, strict=True):
        assert (tuple(f.shape), f.dtype, f.stride()) == (tuple(r.shape), r.dtype, r.stride())


def test_autocast_casts_query_key_value_like_sdpa(attention):
    """RoPE leaves q/k f32 while v is bf16 under autocast: the op runs in bf16, as SDPA does;
    sinks stay f32 and get an f32 gradient."""
    generator = torch.Generator().manual_seed(2)
    q = torch.randn(1, 4, 6, 8, generator=generator, requires_grad=True)
    k = torch.randn(1, 2, 6, 8, generator=generator, requires_grad=True)
    v = torch.randn(1, 2, 6, 8, generator=generator).bfloat16().requires_grad_()
    sinks = torch.zeros(4, requires_grad=True)
    with pytest.raises(KernelInputError, match="must share a dtype"):
        attention.dot_product_attention(q, k, v, causal=True)  # no autocast: refused
    with torch.autocast("cpu", torch.bfloat16):
        got = attention.dot_product_attention(q, k, v, causal=True, sinks=sinks)
        want = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True
        )
    assert got.dtype == want.dtype == torch.bfloat16
    # A zero sink adds exp(0 - max) to the denominator: compare with it folded into SDPA's output.
    got.float().sum().backward()
    assert sinks.grad is not None and sinks.grad.dtype == torch.float32
    assert q.grad.dtype == torch.float32 and v.grad.dtype == torch.bfloat16
    no_sinks = attention.dot_product_attention(q.bfloat16(), k.bfloat16(), v, causal=True)
    assert (no_sinks.float() - want.float()).abs().max() <= 2e-2
