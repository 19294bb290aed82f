"""Attention dropout in the flash kernel (Pallas interpret mode, TPU-legal 16 x 16 blocks with
several per axis): the kernel equals the XLA reference given the same seed, forward and
gradients; rate 0 is bit-identical to no dropout; the mask's keep rate and the 1 / (1 - p)
scaling hold statistically; seeds, heads and rows get different masks."""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest


@pytest.fixture(scope="module")
def parts(attention):
    api = attention.jax
    dropout = sys.modules[api.__name__.rsplit(".", 1)[0] + ".dropout"]
    return api.pallas_tpu, api.reference, dropout, api.AttentionSpec


SEED, RATE = jnp.int32(1234), 0.3


def arrays(batch, q_heads, kv_heads, q_len, kv_len, dim=16):
    rng = np.random.default_rng(0)

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.float32)

    return (
        normal(batch, q_heads, q_len, dim),
        normal(batch, kv_heads, kv_len, dim),
        normal(batch, kv_heads, kv_len, dim),
        normal(q_heads),
        normal(batch, q_heads, q_len, dim),
        normal(batch, q_heads, q_len),
    )


def outputs_and_grads(fn, q, k, v, sinks, d_out, d_lse):
    """(out, lse, dq, dk, dv, d_sinks) of ``fn`` in one jitted call."""

    @jax.jit
    def run(q, k, v, sinks, d_out, d_lse):
        (out, lse), pullback = jax.vjp(fn, q, k, v, sinks)
        return (out, lse, *pullback((d_out, d_lse)))

    return run(q, k, v, sinks, d_out, d_lse)


@pytest.mark.parametrize(
    "shape, options",
    [
        ((1, 4, 2, 40, 56), {"causal": True, "softcap": 5.0}),
        ((1, 8, 1, 3, 70), {"causal": True}),  # decode: q blocks of whole head groups
    ],
    ids=["gqa-causal-softcap-sinks", "decode-mqa"],
)
def test_kernel_equals_reference_with_the_same_seed(parts, shape, options):
    pallas_tpu, reference, _, spec_type = parts
    q, k, v, sinks, d_out, d_lse = arrays(*shape)
    spec = spec_type(**options).resolved(q.shape[-1])
    blocks = pallas_tpu.KernelBlocks(*[pallas_tpu.BlockSizes(16, 16)] * 2)

    def kernel(q, k, v, s):
        return pallas_tpu.attention(q, k, v, None, s, spec, blocks, True, SEED, RATE)

    def plain(q, k, v, s):
        return reference.attention(q, k, v, None, spec, sinks=s, dropout=(SEED, RATE))

    got = outputs_and_grads(kernel, q, k, v, sinks, d_out, d_lse)
    want = outputs_and_grads(plain, q, k, v, sinks, d_out, d_lse)
    undropped = reference.attention(q, k, v, None, spec, sinks=sinks)[0]
    assert float(jnp.max(jnp.abs(want[0] - undropped))) > 0.1  # the mask does drop
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv", "d_sinks"), got, want, strict=True):
        error = float(jnp.max(jnp.abs(g - w)))
        assert error <= 1e-5 * max(1.0, float(jnp.max(jnp.abs(w)))), f"{name}: {error:.3g}"


def test_rate_zero_is_bit_identical_to_no_dropout(parts):
    pallas_tpu, _, _, spec_type = parts
    q, k, v, sinks, d_out, d_lse = arrays(1, 2, 1, 40, 40)
    spec = spec_type(causal=True).resolved(q.shape[-1])
    blocks = pallas_tpu.KernelBlocks(*[pallas_tpu.BlockSizes(16, 16)] * 2)

    def run(*dropout):
        def fn(q, k, v, s):
            return pallas_tpu.attention(q, k, v, None, s, spec, blocks, True, *dropout)

        return outputs_and_grads(fn, q, k, v, sinks, d_out, d_lse)

    for got, want in zip(run(SEED, 0.0), run(), strict=True):
        assert bool(jnp.all(got == want))


def test_keep_rate_and_scaling(parts):
    """Uniform scores and unit values: each output is (kept keys / keys) / (1 - p), whose mean
    over 2M draws is 1 (the keep rate is 1 - p, within 5 standard deviations)."""
    _, reference, dropout, spec_type = parts
    batch, heads, q_len, kv_len = 4, 8, 64, 1024
    kept = dropout.mask(SEED, batch, heads, q_len, kv_len, RATE)
    sigma = np.sqrt(RATE * (1 - RATE) / kept.size)
    assert abs(float(kept.mean()) - (1 - RATE)) < 5 * sigma
    q = jnp.zeros((batch, heads, q_len, 8), jnp.float32)
    v = jnp.ones((batch, heads, kv_len, 8), jnp.float32)
    out, _ = reference.attention(
        q, q[:, :, :1].repeat(kv_len, 2), v, None, spec_type().resolved(8), dropout=(SEED, RATE)
    )
    assert abs(float(out.mean()) - 1.0) < 5 * sigma / (1 - RATE)


def test_masks_differ_between_seeds_heads_and_rows(parts):
    _, _, dropout, _ = parts
    a = np.asarray(dropout.mask(SEED, 2, 4, 32, 256, RATE))
    b = np.asarray(dropout.mask(SEED + 1, 2, 4, 32, 256, RATE))
    independent = RATE**2 + (1 - RATE) ** 2  # how often two independent draws agree
    for x, y in ((a, b), (a[:, 0], a[:, 1]), (a[0], a[1]), (a[:, :, 0], a[:, :, 1])):
        assert abs(float((x == y).mean()) - independent) < 0.02
    assert np.array_equal(a, np.asarray(dropout.mask(SEED, 2, 4, 32, 256, RATE)))


@pytest.mark.slow
@pytest.mark.tpu_compile
def test_dropout_kernels_compile_for_tpu(parts):
    """Mosaic lowers the in-kernel hash (int32 multiplies, logical shifts, the packed rows'
    division): prefill and decode (whole head groups) layouts, forward and backward, v5e."""
    pytest.importorskip("libtpu")
    from kernel_hub.bench.cases import KernelCase
    from kernel_hub.bench.compile_check import compile_case

    pallas_tpu, _, _, spec_type = parts
    spec = spec_type(causal=True).resolved(128)
    blocks = pallas_tpu.KernelBlocks(*[pallas_tpu.BlockSizes(256, 512)] * 2)

    def fn(q, k, v, seed, implementation=None):
        return pallas_tpu.attention(q, k, v, None, None, spec, blocks, False, seed, 0.1)[0]

    def struct(*shape, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype)

    for name, q_heads, kv_heads, q_len in (("prefill", 8, 2, 2048), ("decode", 8, 1, 4)):
        kv = struct(1, kv_heads, 2048, 128)
        case = KernelCase(
            name=f"dropout-{name}",
            fn=fn,
            args=(struct(1, q_heads, q_len, 128), kv, kv, struct(dtype=jnp.int32)),
            kwargs={},
            differentiable=(0, 1, 2),
        )
        for direction in ("forward", "backward"):
            result = compile_case("attention", case, "v5e", direction)
            assert result.ok, f"{name} {direction}: {result.error}"
