"""causal-conv1d: values and gradients against a float64 torch oracle across token blocks, with
initial states and packed sequences (both implementations, f32 and bf16), exactness against
Transformers' causal_conv1d_fn / causal_conv1d_update fallbacks, the torch op contract, errors."""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import pytest
import torch
import torch.nn.functional as F

from kernel_hub import get_kernel
from kernel_hub.errors import KernelInputError, NoImplementationError
from kernel_hub.testing import max_errors

conv = get_kernel("causal-conv1d")
# Default Pallas blocks are 256 tokens x 512 channels: 640 channels and the lengths below give
# several blocks on both axes, ragged last ones included.
CHANNELS = 640
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
IMPLEMENTATIONS = ["xla", "pallas"]


def oracle(x, weight, bias=None, initial_state=None, cu_seqlens=None, silu=True):
    """float64 conv through torch's conv1d, one sequence at a time."""
    x, weight = x.double(), weight.double()
    bias = None if bias is None else bias.double()
    if initial_state is not None:
        x = torch.cat([initial_state.double(), x], 1)
    pieces = (
        [x]
        if cu_seqlens is None
        else [x[:, s:e] for s, e in itertools.pairwise(cu_seqlens.tolist())]
    )
    outs = []
    for piece in (p for p in pieces if p.shape[1]):
        y = F.conv1d(
            piece.transpose(1, 2),
            weight[:, None],
            bias,
            padding=weight.shape[1] - 1,
            groups=weight.shape[0],
        )[..., : piece.shape[1]]
        outs.append(y.transpose(1, 2))
    y = torch.cat(outs, 1)
    if initial_state is not None:
        y = y[:, initial_state.shape[1] :]
    return F.silu(y) if silu else y


def check_close(name, got, want, dtype):
    abs_err, rel_err = max_errors(got, want)
    scale = max(1.0, float(want.abs().max()))
    assert abs_err <= TOL[dtype] * scale, f"{name}: max abs {abs_err:.3g}, max rel {rel_err:.3g}"


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize(
    ("length", "dtype", "with_state"),
    [
        (1, torch.float32, True),
        (257, torch.float32, False),
        (600, torch.float32, True),
        (255, torch.bfloat16, True),
    ],
    ids=str,
)
def test_matches_float64_oracle(with_state, length, dtype, implementation):
    x = torch.randn(2, length, CHANNELS).to(dtype)
    weight, bias = torch.randn(CHANNELS, 4).to(dtype), torch.randn(CHANNELS).to(dtype)
    state = torch.randn(2, 3, CHANNELS).to(dtype) if with_state else None
    y = conv.causal_conv1d(x, weight, bias, state, None, "silu", implementation)
    assert y.dtype == dtype and y.shape == x.shape
    check_close("y", y, oracle(x, weight, bias, state), dtype)


@pytest.mark.parametrize(("width", "implementation"), [(4, "xla"), (4, "pallas"), (2, "pallas")])
def test_packed_sequences_start_from_zeros(width, implementation):
    cu = torch.tensor([0, 2, 2, 255, 300, 520], dtype=torch.int32)
    x, weight = torch.randn(1, 520, CHANNELS), torch.randn(CHANNELS, width)
    y = conv.causal_conv1d(x, weight, None, None, cu, None, implementation)
    check_close("y", y, oracle(x, weight, cu_seqlens=cu, silu=False), torch.float32)


def packed_oracle(x, weight, bias, states, cu_seqlens):
    """Each packed sequence through the oracle on its own, from its own initial state."""
    pieces = [
        oracle(x[:, s:e], weight, bias, states[n : n + 1])
        for n, (s, e) in enumerate(itertools.pairwise(cu_seqlens.tolist()))
        if e > s
    ]
    return torch.cat(pieces, 1)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("width", "dtype", "implementation"),
    [(4, torch.float32, "xla"), (4, torch.bfloat16, "pallas"), (1, torch.float32, "xla")],
    ids=str,
)
def test_packed_sequences_start_from_their_own_states(width, dtype, implementation):
    """Values and gradients (x, weight, bias, states); sequences shorter than the width, an
    empty one, and one crossing the 256-token block."""
    cu = torch.tensor([0, 2, 2, 255, 300, 520], dtype=torch.int32)
    channels = 128  # one channel block: the token blocks are what the states shift
    inputs = [
        torch.randn(1, 520, channels).to(dtype),
        torch.randn(channels, width).to(dtype),
        torch.randn(channels).to(dtype),
        torch.randn(5, width - 1, channels).to(dtype),
    ]
    leaves = [t.clone().requires_grad_() for t in inputs]
    x, weight, bias, states = leaves
    y = conv.causal_conv1d(x, weight, bias, states, cu, "silu", implementation)
    ref = [t.double().requires_grad_() for t in inputs]
    want = packed_oracle(*ref, cu)
    check_close("y", y, want, dtype)
    grad = torch.randn(y.shape).to(dtype)
    y.backward(grad)
    want.backward(grad.double())
    for name, got, expected in zip(("x", "weight", "bias", "state"), leaves, ref, strict=True):
        if expected.numel():  # width 1: the states are empty
            check_close(f"d{name}", got.grad, expected.grad, dtype)


@pytest.mark.parametrize(
    ("dtype", "implementation"),
    [(torch.float32, "xla"), (torch.float32, "pallas"), (torch.bfloat16, "pallas")],
    ids=str,
)
def test_gradients_match_float64_oracle(dtype, implementation):
    inputs = [
        torch.randn(2, 300, CHANNELS).to(dtype),
        torch.randn(CHANNELS, 4).to(dtype),
        torch.randn(CHANNELS).to(dtype),
        torch.randn(2, 3, CHANNELS).to(dtype),
    ]
    leaves = [t.clone().requires_grad_() for t in inputs]
    y = conv.causal_conv1d(*leaves, None, "silu", implementation)
    grad = torch.randn(y.shape).to(dtype)
    y.backward(grad)
    ref = [t.double().requires_grad_() for t in inputs]
    oracle(*ref).backward(grad.double())
    for name, got, want in zip(("x", "weight", "bias", "state"), leaves, ref, strict=True):
        check_close(f"d{name}", got.grad, want.grad, dtype)


@pytest.mark.parametrize("implementation", ["pallas"])
def test_packed_gradients_match_float64_oracle(implementation):
    cu = torch.tensor([0, 5, 300], dtype=torch.int32)
    x = torch.randn(1, 300, 128, requires_grad=True)
    weight = torch.randn(128, 4, requires_grad=True)
    conv.causal_conv1d(x, weight, None, None, cu, "silu", implementation).sum().backward()
    x64, w64 = (t.detach().double().requires_grad_() for t in (x, weight))
    oracle(x64, w64, cu_seqlens=cu).sum().backward()
    check_close("dx", x.grad, x64.grad, torch.float32)
    check_close("dweight", weight.grad, w64.grad, torch.float32)


@pytest.mark.parametrize(
    ("width", "cu_seqlens"),
    [(9, None), (4, (0, 254, 258, 300))],
    ids=["width9-state", "packed-across-block-edge"],
)
def test_pallas_backward_equals_xla_vjp(width, cu_seqlens):
    """The Pallas backward against jax.vjp of the XLA form at 256-token x 128-channel blocks
    (2 x 2 blocks, ragged last token block): the widest reach (the 8 rows after a block feed
    its dx), an initial state's gradient, packed sequences starting on both sides of a block
    edge."""
    keys = jax.random.split(jax.random.PRNGKey(width), 5)
    x = jax.random.normal(keys[0], (1, 300, 256))
    weight, bias = jax.random.normal(keys[1], (256, width)), jax.random.normal(keys[2], (256,))
    state = None if cu_seqlens else jax.random.normal(keys[3], (1, width - 1, 256))
    cu = None if cu_seqlens is None else jnp.asarray(cu_seqlens, jnp.int32)
    grad = jax.random.normal(keys[4], x.shape)
    config = conv.jax.pallas_tpu.BlockConfig(256, 128)

    @functools.partial(jax.jit, static_argnums=0)  # one program each, not primitive by primitive
    def vjp(implementation, x, weight, bias, state, grad):
        def run(x, weight, bias, state):
            return conv.jax.causal_conv1d(
                x,
                weight,
                bias,
                state,
                cu,
                activation="silu",
                implementation=implementation,
                config=config,
            )

        return jax.vjp(run, x, weight, bias, state)[1](grad)

    for name, got, want in zip(
        ("dx", "dweight", "dbias", "dstate"),
        vjp("pallas", x, weight, bias, state, grad),
        vjp("xla", x, weight, bias, state, grad),
        strict=True,
    ):
        if want is None:
            assert got is None, name
            continue
        check_close(name, torch.from_dlpack(got), torch.from_dlpack(want), torch.float32)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_equals_transformers_fallbacks(dtype, implementation):
    from transformers.models.qwen3_next import modeling_qwen3_next as stock

    x = torch.randn(2, 45, 256).to(dtype)
    weight, bias = torch.randn(256, 4).to(dtype), torch.randn(256).to(dtype)
    want = stock.causal_conv1d_fn(x.transpose(1, 2), weight, bias, activation="silu")
    got = conv.causal_conv1d(x, weight, bias, activation="silu", implementation=implementation)
    check_close("causal_conv1d_fn", got, want.transpose(1, 2), dtype)
    for tokens in (1, 3):
        step = torch.randn(2, tokens, 256).to(dtype)
        state = torch.randn(2, 4, 256).to(dtype)  # Transformers keeps W inputs
        stock_state = state.transpose(1, 2).contiguous()
        want = stock.causal_conv1d_update(step.transpose(1, 2), stock_state, weight, bias, "silu")
        got, new_state = conv.causal_conv1d_update(
            step, state, weight, bias, "silu", implementation
        )
        check_close("update y", got, want.transpose(1, 2), dtype)
        torch.testing.assert_close(new_state, stock_state.transpose(1, 2), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_transformers_slot_functions_equal_the_fallbacks(dtype):
    """The functions kernelize puts in the mixers' slots: Transformers' signatures and layouts
    (channels first), the conv state overwritten in place, unknown arguments refused."""
    from transformers.models.qwen3_next import modeling_qwen3_next as stock

    slots = conv.KERNEL.integration("transformers").register()
    assert set(slots) == {"causal_conv1d_fn", "causal_conv1d_update"}
    x = torch.randn(2, 256, 45).to(dtype)
    weight, bias = torch.randn(256, 4).to(dtype), torch.randn(256).to(dtype)
    want = stock.causal_conv1d_fn(x, weight, bias, activation="silu")
    check_close("causal_conv1d_fn", slots["causal_conv1d_fn"](x, weight, bias, "silu"), want, dtype)
    step, state = torch.randn(2, 256, 1).to(dtype), torch.randn(2, 256, 4).to(dtype)
    stock_state = state.clone()
    want = stock.causal_conv1d_update(step, stock_state, weight, bias, "silu")
    got = slots["causal_conv1d_update"](step, state, weight, bias, "silu")
    check_close("causal_conv1d_update", got, want, dtype)
    torch.testing.assert_close(state, stock_state, rtol=0, atol=0)
    with pytest.raises(TypeError, match="seq_idx"):
        slots["causal_conv1d_fn"](x, weight, bias, "silu", seq_idx=torch.zeros(2, 45))


def test_float64_gradcheck():
    leaves = (
        torch.randn(1, 20, 8, dtype=torch.float64, requires_grad=True),
        torch.randn(8, 3, dtype=torch.float64, requires_grad=True),
        torch.randn(8, dtype=torch.float64, requires_grad=True),
        torch.randn(1, 2, 8, dtype=torch.float64, requires_grad=True),
    )
    for implementation in IMPLEMENTATIONS:
        assert torch.autograd.gradcheck(
            lambda *xs, impl=implementation: conv.causal_conv1d(
                *xs, activation="silu", implementation=impl
            ),
            leaves,
        )
    assert not jax.config.jax_enable_x64, "the global x64 flag must stay off"


@pytest.mark.slow
def test_opcheck():
    x = torch.randn(1, 20, 128, requires_grad=True)
    weight, bias = torch.randn(128, 4, requires_grad=True), torch.randn(128, requires_grad=True)
    state = torch.randn(1, 3, 128, requires_grad=True)
    for op, args in (
        (conv.causal_conv1d, (x, weight, bias, state, None, "silu")),
        (conv.causal_conv1d, (x, weight, None, None, torch.tensor([0, 7, 20]), None)),
        (conv.causal_conv1d_update, (x[:, :2].detach(), torch.randn(1, 4, 128), weight.detach())),
    ):
        result = torch.library.opcheck(op.op, args)
        assert set(result.values()) == {"SUCCESS"}, result


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"weight": torch.randn(64, 4)}, r"weight has shape \(64, 4\)"),
        ({"bias": torch.randn(3)}, r"bias has shape \(3,\)"),
        ({"initial_state": torch.randn(2, 4, 128)}, "initial_state has shape"),
        ({"activation": "gelu"}, "activation='gelu'; valid"),
        ({"cu_seqlens": torch.tensor([0, 3])}, "batch of one; got batch 2"),
    ],
)
def test_bad_inputs_are_refused_with_the_reason(kwargs, message):
    args = {"x": torch.randn(2, 10, 128), "weight": torch.randn(128, 4), **kwargs}
    with pytest.raises(KernelInputError, match=message):
        conv.causal_conv1d(**args)


def test_refusals_name_the_limit():
    x = torch.randn(1, 10, 128)
    with pytest.raises(KernelInputError, match=r"it must be \[sequences .* = \[2, 3, 128\]"):
        conv.causal_conv1d(
            x, torch.randn(128, 4), None, torch.randn(1, 3, 128), torch.tensor([0, 4, 10])
        )
    with pytest.raises(NoImplementationError, match="at most 9 taps"):
        conv.causal_conv1d(x, torch.randn(128, 12), implementation="pallas")
    with pytest.raises(KernelInputError, match="S >= width - 1 = 3"):
        conv.causal_conv1d_update(x[:, :1], torch.randn(1, 2, 128), torch.randn(128, 4))
