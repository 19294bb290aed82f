"""Bad inputs get a clear error naming what was wrong and what is valid, before any kernel runs;
the torch op checks the same rules."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from kernel_hub import get_kernel
from kernel_hub.errors import KernelInputError

fused = get_kernel("fused-moe")
api = fused.jax


def args(tokens=4, hidden=128, inter=128, experts=4, top_k=2, dtype=jnp.float32):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((tokens, hidden)), dtype)
    ids = jnp.asarray(np.tile(np.arange(top_k), (tokens, 1)), jnp.int32)
    w = jnp.ones((tokens, top_k), jnp.float32)
    w1 = jnp.zeros((experts, 2 * inter, hidden), dtype)
    w2 = jnp.zeros((experts, hidden, inter), dtype)
    return [x, ids, w, w1, w2]


@pytest.mark.parametrize(
    "change,kwargs,message",
    [
        (lambda a: a.__setitem__(0, a[0][None]), {}, "hidden_states must have rank 2"),
        (lambda a: a.__setitem__(1, a[1].astype(jnp.float32)), {}, "top_k_index has dtype"),
        (lambda a: a.__setitem__(2, a[2][:, :1]), {}, r"must both be \[4, k\]"),
        (lambda a: a.__setitem__(3, a[3].astype(jnp.bfloat16)), {}, "w_gate_up has dtype"),
        (lambda a: a.__setitem__(4, a[4][:, :, :64]), {}, r"w_down .* must be"),
        (lambda a: None, {"activation": "relu"}, "activation must be one of"),
        (lambda a: None, {"quantization": "int4"}, "quantization must be None or one of"),
        (lambda a: None, {"quantization": "int8"}, "w_gate_up has dtype float32; supported: int8"),
        (lambda a: None, {"quantization": "fp8", "transposed": True}, "transposed=True is not"),
        (lambda a: None, {"transposed": True}, r"read as \[E, H, 2I\]"),
    ],
)  # fmt: skip
def test_bad_inputs_are_named(change, kwargs, message):
    a = args()
    change(a)
    with pytest.raises(KernelInputError, match=message):
        api.fused_experts(*a, **kwargs)


def test_missing_or_misshaped_scales():
    a = args()
    q1, s1 = fused.quant.quantize(a[3], "int8")
    q2, s2 = fused.quant.quantize(a[4], "int8")
    with pytest.raises(KernelInputError, match=r"needs down_scale of shape \(4, 128\)"):
        api.fused_experts(*a[:3], q1, q2, None, None, s1, None, quantization="int8")
    with pytest.raises(KernelInputError, match="given without quantization"):
        api.fused_experts(*a, None, None, s1, s2)


def test_fp8_needs_whole_blocks():
    a = args(hidden=64, inter=64)
    q1 = a[3].astype(jnp.float8_e4m3fn)
    q2 = a[4].astype(jnp.float8_e4m3fn)
    s1, s2 = jnp.ones((4, 1, 1)), jnp.ones((4, 1, 1))
    with pytest.raises(KernelInputError, match="multiples of 128"):
        api.fused_experts(*a[:3], q1, q2, None, None, s1, s2, quantization="fp8")


def test_illegal_blocks_name_the_rule():
    a = args()
    with pytest.raises(Exception, match="ti=96 must divide the intermediate size 128"):
        api.fused_experts(*a, implementation="pallas", blocks=api.Blocks(8, 96))
    with pytest.raises(Exception, match="tm=4 must be a positive multiple of 8"):
        api.fused_experts(*a, implementation="pallas", blocks=api.Blocks(4, 128))


@pytest.mark.parametrize(
    "router,message",
    [(dict(top_k=9), r"top_k=9 must be in \[1, 4\]"),
     (dict(top_k=2, groups=3, top_groups=1), "groups=3 must divide the 4 experts"),
     (dict(top_k=2, groups=2), "groups and top_groups go together"),
     (dict(top_k=2, scoring="relu"), "scoring must be one of")],
)  # fmt: skip
def test_bad_routers_are_named(router, message):
    a = args()
    logits = jnp.zeros((4, 4))
    with pytest.raises(KernelInputError, match=message):
        api.fused_moe(a[0], logits, a[3], a[4], **router)


def test_torch_op_checks_before_running():
    x = torch.randn(4, 128)
    ids = torch.zeros(4, 2, dtype=torch.int64)
    with pytest.raises(KernelInputError, match=r"w_down .* must be"):
        fused.fused_experts(x, ids, torch.ones(4, 2), torch.zeros(4, 256, 128),
                            torch.zeros(4, 128, 64))  # fmt: skip


def test_zero_tokens_give_an_empty_result():
    a = args(tokens=0)
    out = api.fused_experts(*a)
    assert out.shape == (0, 128)


def test_expert_parallel_takes_fused_experts_arguments():
    """``fused_experts_ep``'s parameters are ``fused_experts``'s (read from it), less the sharding
    boundary's ``split_axes``, and ``axis``; an unknown keyword is named; on a one-device ep mesh
    it gives ``fused_experts``'s result."""
    import inspect

    import jax

    from kernel_hub import use_mesh

    ep = fused.expert_parallel.fused_experts_ep
    own = list(inspect.signature(api.fused_experts).parameters.values())
    assert own[-1].name == "split_axes"
    own = own[:-1]
    assert list(inspect.signature(ep).parameters.values())[:-1] == own
    assert str(list(inspect.signature(ep).parameters.values())[-1]) == "axis: str = 'ep'"
    a = args()
    a[3] = jnp.asarray(np.random.default_rng(1).standard_normal(a[3].shape) / 8, jnp.float32)
    a[4] = jnp.asarray(np.random.default_rng(2).standard_normal(a[4].shape) / 8, jnp.float32)
    with pytest.raises(KernelInputError, match=r"fused_experts_ep: unknown options \['gate'\]"):
        ep(*a, gate="silu")
    with pytest.raises(KernelInputError, match="fused_experts_ep: needs a mesh with an 'ep' axis"):
        ep(*a)
    mesh = jax.make_mesh((1,), ("ep",), devices=jax.devices()[:1])
    with use_mesh(mesh):
        with pytest.raises(KernelInputError, match="activation must be one of"):
            ep(*a, activation="relu")
        got = ep(*a, activation="gelu", implementation="xla")
    expected = api.fused_experts(*a, activation="gelu", implementation="xla")
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-6, atol=1e-6)
