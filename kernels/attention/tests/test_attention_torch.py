"""Torch ops: parity with torch SDPA, f64 gradcheck, opcheck, saved-output backward, bad input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernel_hub.errors import KernelInputError


def _qkv(
    batch=1,
    q_heads=4,
    kv_heads=2,
    q_len=10,
    kv_len=10,
    head_dim=8,
    dtype=torch.float32,
    requires_grad=False,
    seed=0,
):
    generator = torch.Generator().manual_seed(seed)

    def make(*shape):
        return torch.randn(*shape, generator=generator, dtype=dtype).requires_grad_(requires_grad)

    return (
        make(batch, q_heads, q_len, head_dim),
        make(batch, kv_heads, kv_len, head_dim),
        make(batch, kv_heads, kv_len, head_dim),
    )


def _max_error(a, b) -> float:
    return (a.double() - b.double()).abs().max().item()


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_matches_torch_sdpa(attention, implementation):
    q, k, v = _qkv(q_len=12, kv_len=12)
    kv_mask = torch.ones(1, 12, dtype=torch.bool)
    kv_mask[0, :3] = False
    got = attention.dot_product_attention(
        q, k, v, kv_mask, causal=True, implementation=implementation
    )
    sdpa_mask = torch.ones(12, 12, dtype=torch.bool).tril() & kv_mask[:, None, None, :]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask, enable_gqa=True)
    error = _max_error(got, want)
    assert error <= 1e-5, f"{implementation}: max abs error {error:.3g} vs torch sdpa"


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_gradcheck_f64(attention, implementation):
    q, k, v = _qkv(
        q_heads=2,
        kv_heads=1,
        q_len=3,
        kv_len=5,
        head_dim=4,
        dtype=torch.float64,
        requires_grad=True,
    )

    def fn(q, k, v):
        out, lse = attention.attention_with_lse(
            q, k, v, causal=True, sliding_window=4, softcap=3.0, implementation=implementation
        )
        return out, lse

    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-6)


def test_opcheck(attention):
    q, k, v = _qkv(requires_grad=True)
    kv_mask = torch.rand(1, 10) > 0.2
    torch.library.opcheck(
        attention.attention_with_lse.op, (q, k, v, kv_mask), {"causal": True, "softcap": 4.0}
    )


_SEED = torch.tensor(3, dtype=torch.int32)


def test_opcheck_with_dropout(attention):
    q, k, v = _qkv(requires_grad=True)
    seed = _SEED
    torch.library.opcheck(
        attention.attention_with_lse.op,
        (q, k, v),
        {"causal": True, "dropout_seed": seed, "dropout_rate": 0.25},
    )


def test_schemas_keep_earlier_positions(attention):
    """The schemas derived from ``AttentionSpec`` keep 1.0's positions (its options right after
    its tensors), with what 1.1 to 1.6 added after them: a 1.0 positional call keeps its
    meaning, and the derived layout cannot drift unnoticed."""
    names = {
        op: [a.name for a in getattr(attention, op).op._schema.arguments]
        for op in ("attention_with_lse", "attention_forward_only", "attention_with_dense_mask")
    }
    assert names["attention_forward_only"] == names["attention_with_lse"]
    v1_0 = ["causal", "sliding_window", "softcap", "scale", "implementation"]
    assert names["attention_with_lse"] == [
        "query", "key", "value", "kv_mask", "q_segment_ids", "kv_segment_ids", *v1_0, "block_q",
        "block_k", "sinks", "q_positions", "kv_positions", "q_groups", "kv_groups",
        "window_bounds_groups", "dropout_seed", "dropout_rate",
    ]  # fmt: skip
    assert names["attention_with_dense_mask"] == [
        "query", "key", "value", "attention_mask", *v1_0, "sinks", "bias",
    ]  # fmt: skip
    q, k, v = _qkv()
    kv_mask = torch.rand(1, 10) > 0.2
    positional = attention.attention_with_lse(q, k, v, kv_mask, None, None, True, 4, 30.0, 0.5)
    keywords = attention.attention_with_lse(
        q, k, v, kv_mask, causal=True, sliding_window=4, softcap=30.0, scale=0.5
    )
    torch.testing.assert_close(positional, keywords, rtol=0, atol=0)


def test_backward_reuses_saved_outputs(attention, monkeypatch):
    """The Pallas backward must not run the forward kernel again."""
    q, k, v = _qkv(q_len=9, kv_len=9, requires_grad=True)
    out, _ = attention.attention_with_lse(q, k, v, causal=True, implementation="pallas", block_q=32)
    calls = []
    pallas_tpu = attention.jax.pallas_tpu
    monkeypatch.setattr(pallas_tpu, "attention_forward", lambda *a, **kw: calls.append(a))
    out.sum().backward()
    assert calls == [], "the backward recomputed the forward"
    want_q = q.detach().requires_grad_(True)
    F.scaled_dot_product_attention(
        want_q, k.detach(), v.detach(), is_causal=True, enable_gqa=True
    ).sum().backward()
    error = _max_error(q.grad, want_q.grad)
    assert error <= 1e-4, f"dq max abs error {error:.3g}"


def test_no_logsumexp_is_written_without_a_gradient(attention, monkeypatch):
    """The JAX forward-only program's kernel writes out alone (a gradient's forward also writes
    the logsumexp its backward reads); the torch function picks the forward-only op unless
    autograd will differentiate the call."""
    import jax
    import jax.numpy as jnp

    from kernel_hub.testing import pallas_call_outputs

    q, k, v = _qkv(q_len=40, kv_len=40)

    def forward(q, k, v):
        return attention.jax.dot_product_attention(
            q, k, v, causal=True, implementation="pallas", block_q=16, block_k=16
        )

    arrays = [jnp.asarray(t.numpy()) for t in (q, k, v)]
    assert [(name, len(out)) for name, out in pallas_call_outputs(forward, *arrays)] == [
        ("flash_attention_forward", 1)
    ]
    grad = jax.grad(lambda *a: forward(*a).sum(), argnums=(0, 1, 2))
    kernels = pallas_call_outputs(grad, *arrays)
    assert [len(out) for name, out in kernels if name == "flash_attention_forward"] == [2]

    ran = []
    functions = attention.dot_product_attention.__globals__
    for name in ("attention_with_lse", "attention_forward_only"):
        op = functions[name]
        monkeypatch.setitem(
            functions, name, lambda *a, _n=name, _op=op, **kw: (ran.append(_n), _op(*a, **kw))[1]
        )
    q.requires_grad_(True)
    with torch.no_grad():
        inference = attention.dot_product_attention(q, k, v, causal=True)
    training = attention.dot_product_attention(q, k, v, causal=True)
    assert ran == ["attention_forward_only", "attention_with_lse"]
    torch.testing.assert_close(inference, training.detach(), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("shapes", "options", "message"),
    [
        (
            {"q_heads": 4, "kv_heads": 3},
            {},
            "must divide query's 4 heads.*valid kv head counts: 1, 2, 4",
        ),
        ({"q_heads": 4, "kv_heads": 2, "mismatched_head_dim": True}, {}, "expected .*head_dim"),
        ({}, {"kv_mask_shape": (1, 7)}, r"kv_mask has shape \(1, 7\); expected \(1, 10\)"),
        ({}, {"sliding_window": 0}, "sliding_window=0; it must be an integer >= 1"),
        ({}, {"sliding_window": -3}, "sliding_window=-3; it must be an integer >= 1"),
        ({}, {"softcap": 0.0}, "softcap=0.0; it must be a finite number > 0"),
        ({}, {"dropout_rate": 1.0, "dropout_seed": _SEED}, r"dropout_rate=1.0; .* in \[0, 1\)"),
        ({}, {"dropout_rate": -0.1, "dropout_seed": _SEED}, r"dropout_rate=-0.1; .* \[0, 1\)"),
        ({}, {"dropout_rate": 0.1}, "dropout_rate=0.1 needs dropout_seed"),
        ({}, {"dropout_rate": 0.1, "dropout_seed": _SEED[None]}, "dropout_seed has shape"),
        ({}, {"dropout_rate": 0.1, "dropout_seed": _SEED.float()}, "dropout_seed"),
    ],
)
def test_bad_inputs_are_rejected(attention, shapes, options, message):
    shapes = dict(shapes)
    mismatched = shapes.pop("mismatched_head_dim", False)
    q, k, v = _qkv(**shapes)
    if mismatched:
        k, v = k[..., :4].contiguous(), v[..., :4].contiguous()
    options = dict(options)
    kv_mask_shape = options.pop("kv_mask_shape", None)
    kv_mask = None if kv_mask_shape is None else torch.ones(kv_mask_shape, dtype=torch.bool)
    with pytest.raises(KernelInputError, match=message):
        attention.dot_product_attention(q, k, v, kv_mask, **options)
    # The JAX API applies the same rules.
    import jax.numpy as jnp

    arrays = [jnp.asarray(t.numpy()) for t in (q, k, v)]
    jax_mask = None if kv_mask is None else jnp.asarray(kv_mask.numpy())
    jax_options = {
        n: jnp.asarray(o.numpy()) if isinstance(o, torch.Tensor) else o for n, o in options.items()
    }
    with pytest.raises(KernelInputError, match=message):
        attention.jax.dot_product_attention(*arrays, jax_mask, **jax_options)


def test_dense_mask_of_wrong_shape_is_rejected(attention):
    q, k, v = _qkv()
    with pytest.raises(
        KernelInputError, match=r"attention_mask has shape \(1, 1, 10, 9\); expected"
    ):
        attention.attention_with_dense_mask(q, k, v, torch.ones(1, 1, 10, 9, dtype=torch.bool))


def test_blocks_must_be_powers_of_two(attention):
    q, k, v = _qkv()
    with pytest.raises(Exception, match="block_q=12 must be a power of two"):
        attention.dot_product_attention(q, k, v, implementation="pallas", block_q=12)
    with pytest.raises(Exception, match="block_q=0 must be a power of two"):  # not the default
        attention.dot_product_attention(q, k, v, implementation="pallas", block_q=0)


def test_order_change_takes_effect_for_shapes_that_already_ran(attention, monkeypatch):
    """A shape traced under one implementation order runs the new first implementation after
    the order changes (no cache clearing by hand), forward and backward."""
    table, pallas_tpu = attention.jax.TABLE, attention.jax.pallas_tpu
    ran = []
    for name in ("attention_forward", "attention_backward"):
        original = getattr(pallas_tpu, name)

        def recording(*args, _original=original, _name=name, **kwargs):
            ran.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(pallas_tpu, name, recording)
    q = torch.randn(1, 2, 8, 16, requires_grad=True)
    k, v = torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
    saved = table.order("cpu")
    try:
        table.set_order("cpu", ("xla", "pallas"))
        attention.attention_with_lse(q, k, v, causal=True)[0].sum().backward()
        assert ran == [], "the xla order ran the Pallas kernel"
        table.set_order("cpu", ("pallas", "xla"))
        attention.attention_with_lse(q, k, v, causal=True)[0].sum().backward()
        assert ran == ["attention_forward", "attention_backward"], ran
    finally:
        table.set_order("cpu", saved)


def test_backward_contract_is_checked_by_name_at_definition(attention):
    """The bridge passes the op's tensors to the JAX backward by position, then the saved outputs
    and cotangents: a reordered or missing one fails when the op is declared (``op``)."""
    import inspect

    from kernel_hub.kernel_api import SavedBackward, op, takes_options

    api = attention.jax
    forward = takes_options(api.AttentionSpec)(inspect.unwrap(api.dot_product_attention_with_lse))

    def declare(saved):
        backward = SavedBackward(api.attention_backward, saved)
        op(name="kh_test_contract", jax_backward=backward, jax_only=("split_axes",))(forward)

    with pytest.raises(TypeError, match=r"JAX backward disagree: .*\(.*, lse, out, d_out"):
        declare(("lse", "out", "d_out", "d_lse"))
    with pytest.raises(TypeError, match="requires d_lse, which the stub lacks"):
        declare(("out", "lse", "d_out"))
    declare(("out", "lse", "d_out", "d_lse"))  # agrees
