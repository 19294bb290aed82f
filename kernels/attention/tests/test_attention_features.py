"""Attention sinks, value head dim != q/k head dim (MLA) and additive biases, values and gradients.

Every implementation is checked against ``_oracle``: repeated kv heads, one dense softmax with the
sink as an extra column, written here independently of ``reference.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from attention_helpers import assert_close

_MASKED = -1e30
BLOCKS = {"block_q": 16, "block_k": 16}


def _oracle(q, k, v, *, scale, causal, kv_mask=None, sinks=None, bias=None, mask=None):
    """(out, lse) by the definition: softmax over [scores, sink] with a zero value for the sink."""
    groups = q.shape[1] // k.shape[1]
    k, v = jnp.repeat(k, groups, axis=1), jnp.repeat(v, groups, axis=1)
    hp = jax.lax.Precision.HIGHEST
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k, precision=hp) * scale
    if bias is not None:
        s = s + bias
    q_len, kv_len = q.shape[2], k.shape[2]
    allowed = jnp.ones((1, 1, q_len, kv_len), bool)
    if causal:
        allowed &= jnp.arange(kv_len)[None, :] <= jnp.arange(q_len)[:, None] + kv_len - q_len
    if kv_mask is not None:
        allowed = allowed & kv_mask[:, None, None, :]
    if mask is not None:
        allowed = allowed & mask
    s = jnp.where(allowed, s, _MASKED)
    if sinks is not None:
        column = jnp.broadcast_to(sinks[None, :, None, None], (*s.shape[:3], 1))
        s = jnp.concatenate([s, column], axis=-1)
    m = jnp.max(s, axis=-1, keepdims=True)
    e = jnp.exp(s - m)
    total = jnp.sum(e, axis=-1, keepdims=True)
    p = e / total
    if sinks is not None:
        p = p[..., :-1]
    return jnp.einsum("bhqk,bhkd->bhqd", p, v, precision=hp), (m + jnp.log(total))[..., 0]


def _normal(rng, *shape, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape) * scale, jnp.float32)


def _problem(seed=0, batch=2, q_heads=4, kv_heads=2, q_len=20, kv_len=20, d=16, dv=16):
    rng = np.random.default_rng(seed)
    arrays = {
        "query": _normal(rng, batch, q_heads, q_len, d),
        "key": _normal(rng, batch, kv_heads, kv_len, d),
        "value": _normal(rng, batch, kv_heads, kv_len, dv),
    }
    cotangents = (_normal(rng, batch, q_heads, q_len, dv), _normal(rng, batch, q_heads, q_len))
    return rng, arrays, cotangents


def _values_and_grads(fn, arrays, cotangents):
    """(out, lse, *grads of every array) of ``fn(**arrays) -> (out, lse)``, one jitted call."""
    names = list(arrays)

    @jax.jit
    def run(values, cotangents):
        (out, lse), pullback = jax.vjp(lambda *xs: fn(**dict(zip(names, xs, strict=True))), *values)
        return (out, lse, *pullback(cotangents))

    results = run([arrays[n] for n in names], cotangents)
    return dict(zip(["out", "lse", *(f"d{n}" for n in names)], results, strict=True))


def _compare(got, want, what, value_tol=1e-5, grad_tol=1e-4):
    for name, expected in want.items():
        tol = value_tol if name in ("out", "lse") else grad_tol
        assert_close(got[name], expected, tol, f"{what} {name}")


# (name, problem sizes, options, extra inputs)
SINK_CASES = {
    "causal-gqa-key-padding": ({}, {"causal": True}, "kv_mask"),
    "window-ragged": ({"q_len": 13, "kv_len": 29}, {"causal": True, "sliding_window": 7}, ""),
    "decode-mqa-q3-kv70": ({"q_heads": 8, "kv_heads": 1, "q_len": 3, "kv_len": 70}, {}, ""),
    "mla-causal": ({"d": 24, "dv": 12}, {"causal": True}, "kv_mask"),
}


@pytest.mark.parametrize(
    ("implementation", "case"),
    [*(("pallas", case) for case in SINK_CASES), ("xla", "causal-gqa-key-padding")],
)
def test_sinks_match_the_definition(attention, implementation, case):
    sizes, options, extra = SINK_CASES[case]
    rng, arrays, cotangents = _problem(**sizes)
    arrays["sinks"] = _normal(rng, arrays["query"].shape[1], scale=3.0)  # GPT-OSS-like magnitude
    kv_mask = None
    if extra == "kv_mask":
        kv_mask = jnp.asarray(rng.random((arrays["key"].shape[0], arrays["key"].shape[2])) > 0.3)
        kv_mask = kv_mask.at[0].set(False)  # a batch that sees no key: only the sink
    scale = arrays["query"].shape[-1] ** -0.5
    api = attention.jax

    def kernel(query, key, value, sinks):
        return api.dot_product_attention_with_lse(
            query,
            key,
            value,
            kv_mask,
            sinks=sinks,
            implementation=implementation,
            **BLOCKS,
            **options,
        )

    window = options.get("sliding_window")

    def oracle(query, key, value, sinks):
        mask = None
        if window is not None:
            q_len, kv_len = query.shape[2], key.shape[2]
            distance = jnp.arange(q_len)[:, None] + kv_len - q_len - jnp.arange(kv_len)[None, :]
            mask = distance < window
        causal = options.get("causal", False)
        return _oracle(
            query, key, value, scale=scale, causal=causal, kv_mask=kv_mask, sinks=sinks, mask=mask
        )

    got = _values_and_grads(kernel, arrays, cotangents)
    want = _values_and_grads(oracle, arrays, cotangents)
    _compare(got, want, f"{implementation} {case}")
    if kv_mask is not None:
        assert np.all(np.asarray(got["out"][0]) == 0), "rows seeing only the sink must be zeros"


def test_sinks_are_refused_by_tokamax_with_a_reason(attention):
    from kernel_hub.errors import NoImplementationError

    _, arrays, _ = _problem()
    with pytest.raises(NoImplementationError, match="no attention sinks"):
        attention.jax.dot_product_attention(**arrays, sinks=jnp.zeros(4), implementation="tokamax")


def test_positions_are_refused_by_tokamax_with_a_reason(attention):
    """Tokamax 0.0.12 has no positions, segments or mask function its kernel runs (see
    ``api._tokamax_problem``)."""
    from kernel_hub.errors import NoImplementationError

    _, arrays, _ = _problem()
    positions = jnp.broadcast_to(jnp.arange(20, dtype=jnp.int32), (2, 20))
    with pytest.raises(NoImplementationError, match="no per-token positions or groups"):
        attention.jax.dot_product_attention(
            **arrays,
            causal=True,
            q_positions=positions,
            kv_positions=positions,
            implementation="tokamax",
        )


def test_value_head_dim_runs_natively_in_pallas(attention):
    """MLA layout (q/k 24, v 12): the Pallas output has the value's head dim, no padding."""
    _, arrays, cotangents = _problem(d=24, dv=12, q_len=33, kv_len=33)
    api = attention.jax

    def kernel(query, key, value):
        return api.dot_product_attention_with_lse(
            query, key, value, causal=True, implementation="pallas", **BLOCKS
        )

    def oracle(query, key, value):
        return _oracle(query, key, value, scale=24**-0.5, causal=True)

    got = _values_and_grads(kernel, arrays, cotangents)
    assert got["out"].shape == (2, 4, 33, 12)
    _compare(got, _values_and_grads(oracle, arrays, cotangents), "mla pallas")


@pytest.mark.parametrize("bias_shape", ["1,H", "B,1"])
def test_additive_bias_with_its_gradient(attention, bias_shape):
    """T5's position_bias [1, H, Sq, Sk] (and a per-batch one) through the dense-mask path."""
    rng, arrays, cotangents = _problem(q_len=12, kv_len=12)
    batch, heads = arrays["query"].shape[:2]
    shape = (1, heads, 12, 12) if bias_shape == "1,H" else (batch, 1, 12, 12)
    arrays["bias"] = _normal(rng, *shape, scale=2.0)
    mask = jnp.asarray(rng.random((batch, 1, 12, 12)) > 0.2).at[..., 0].set(True)
    dense = attention.dense_mask.attention_with_dense_mask

    def kernel(query, key, value, bias):
        return dense(query, key, value, mask, None, bias, scale=1.0)

    def oracle(query, key, value, bias):
        return _oracle(query, key, value, scale=1.0, causal=False, bias=bias, mask=mask)

    got = _values_and_grads(kernel, arrays, cotangents)
    assert got["dbias"].shape == shape
    _compare(got, _values_and_grads(oracle, arrays, cotangents), f"bias {bias_shape}")


def test_sinks_gradcheck_f64_through_the_torch_op(attention):
    generator = torch.Generator().manual_seed(0)

    def make(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64).requires_grad_()

    q, k, v, sinks = make(1, 2, 3, 4), make(1, 1, 5, 4), make(1, 1, 5, 6), make(2)

    def fn(q, k, v, sinks):
        return attention.attention_with_lse(
            q, k, v, causal=True, implementation="pallas", sinks=sinks
        )

    assert torch.autograd.gradcheck(fn, (q, k, v, sinks), eps=1e-6, atol=1e-6)


def test_bias_gradcheck_f64_through_the_torch_op(attention):
    generator = torch.Generator().manual_seed(1)

    def make(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64).requires_grad_()

    q, k, v, bias = make(1, 2, 4, 4), make(1, 1, 4, 4), make(1, 1, 4, 4), make(1, 2, 4, 4)
    mask = torch.ones(4, 4, dtype=torch.bool).tril()[None, None]

    def fn(q, k, v, bias):
        return attention.attention_with_dense_mask(q, k, v, mask, scale=1.0, bias=bias)

    assert torch.autograd.gradcheck(fn, (q, k, v, bias), eps=1e-6, atol=1e-6)
