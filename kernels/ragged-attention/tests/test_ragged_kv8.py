"""The 8-bit KV cache (``kv_quant``): quantize-on-write error, paged decode over 8-bit pages and
ragged attention over 8-bit keys and values.

Paged: pages of 32 tokens (an 8-bit TPU tile's rows), head_dim 128 (one lane tile) and two pages
per grid step, so each sequence that needs them spans several steps; lengths are ragged (an
empty sequence, one token, page boundaries inside and at the end of a page). Ragged: 128-key
and 32-row blocks, three of each, over prefill chunks, decode and an empty sequence.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from kernel_hub.errors import KernelInputError

PAGE, HEAD_DIM, Q_HEADS, KV_HEADS = 32, 128, 4, 2
LENS = np.array([70, 0, 128, 1, 33], np.int32)
MAX_PAGES = 4  # two grid steps of two pages
DTYPES = ("float8_e4m3fn", "int8")


def _quantized_batch(ragged, dtype_name, seed=0):
    """q, 8-bit pages with scales (written by ``kv_quant.quantize``), table, lens."""
    kv_quant = ragged.jax.kv_quant
    rng = np.random.default_rng(seed)
    num_pages = 1 + sum(-(-int(n) // PAGE) for n in LENS)
    table = -np.ones((len(LENS), MAX_PAGES), np.int32)
    free = list(rng.permutation(num_pages))
    for s, length in enumerate(LENS):
        for j in range(-(-int(length) // PAGE)):
            table[s, j] = free.pop()
    q = rng.standard_normal((len(LENS), Q_HEADS, HEAD_DIM)).astype(np.float32)
    pages, scales = [], []
    for _ in range(2):  # keys, values: per-token magnitudes spread over three decades
        x = rng.standard_normal((num_pages, PAGE, KV_HEADS, HEAD_DIM))
        x *= 10.0 ** rng.uniform(-2, 1, (num_pages, PAGE, KV_HEADS, 1))
        values, scale = kv_quant.quantize(torch.tensor(x), kv_quant.kv_cache_dtype(dtype_name))
        pages.append(values)
        scales.append(scale.transpose(1, 2).contiguous())  # [P, Hkv, page]
    return q, pages, scales, table, LENS


def _jax(t: torch.Tensor):
    return jnp.asarray(t.float().numpy()).astype(str(t.dtype).removeprefix("torch."))


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_quantize_error_is_half_a_step(ragged, dtype_name):
    kv_quant = ragged.jax.kv_quant
    x = torch.randn(64, 3, HEAD_DIM, dtype=torch.float64) * torch.logspace(-3, 2, 64)[:, None, None]
    x[5, 1] = 0.0  # a zero row: scale 1, zeros back
    values, scale = kv_quant.quantize(x, kv_quant.kv_cache_dtype(dtype_name))
    assert values.dtype == getattr(torch, dtype_name) and scale.dtype == torch.float32
    back = values.double() * scale[..., None].double()
    error = (back - x).abs()
    if dtype_name == "int8":  # half a step of max|row| / 127 (and f32 rounding of the scale)
        bound = scale[..., None].double() * (0.5 + 1e-5)
    else:  # e4m3: 3 mantissa bits (2**-4 relative), subnormals below 2**-6 a step of 2**-9
        bound = torch.maximum(x.abs() * 2.0**-4, scale[..., None].double() * 2.0**-10) * (1 + 1e-6)
    assert bool((error <= bound).all()), f"worst {float((error / bound).max()):.3f} of the bound"
    assert scale[5, 1] == 1.0 and not back[5, 1].any()


@pytest.mark.parametrize(
    ("dtype_name", "q_dtype"), [("float8_e4m3fn", jnp.float32), ("int8", jnp.bfloat16)]
)
def test_paged_8bit_matches_reference(ragged, dtype_name, q_dtype):
    """Pallas (interpret, TPU blocks) against the XLA reference, and the reference against a
    float64 computation on the dequantized pages (what the format says the cache holds)."""
    q, pages, scales, table, lens = _quantized_batch(ragged, dtype_name)
    args = (
        jnp.asarray(q, q_dtype),
        *(_jax(p) for p in pages),
        jnp.asarray(table),
        jnp.asarray(lens),
    )
    scale_args = {"k_scales": _jax(scales[0]), "v_scales": _jax(scales[1])}
    out = ragged.jax.paged_attention(
        *args, **scale_args, implementation="pallas", pages_per_block=2, sliding_window=100
    )
    reference = ragged.jax.paged_attention(
        *args, **scale_args, implementation="xla", sliding_window=100
    )
    assert out.dtype == q_dtype
    # bf16: the kernel rounds the probabilities to bf16 for the dot (2**-8 each) and the output
    tolerance = 1e-5 if q_dtype == jnp.float32 else 2.0**-6
    reference = reference.astype(jnp.float32)
    error = float(jnp.abs(out.astype(jnp.float32) - reference).max() / jnp.abs(reference).max())
    assert error < tolerance, f"pallas vs reference: {error:.2e} of the largest output"
    assert not np.asarray(out.astype(jnp.float32))[lens == 0].any()
    if q_dtype == jnp.float32:
        dequantized = [
            p.double().numpy() * s.transpose(1, 2).double().numpy()[..., None]
            for p, s in zip(pages, scales, strict=True)
        ]
        with jax.enable_x64(True):
            exact = ragged.jax.paged_attention(
                jnp.asarray(q, jnp.float64), *dequantized, table, lens, implementation="xla",
                sliding_window=100,
            )  # fmt: skip
        error = float(np.abs(np.asarray(reference) - np.asarray(exact)).max())
        assert error < 1e-5, f"reference vs float64 on the dequantized cache: {error:.2e}"


def test_ragged_8bit_matches_reference(ragged):
    kv_quant = ragged.jax.kv_quant
    rng = np.random.default_rng(1)
    new, past = np.array([1, 40, 0, 3, 1]), np.array([150, 0, 60, 100, 0])
    cu_q = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(new + past)]).astype(np.int32)
    q = rng.standard_normal((int(cu_q[-1]), Q_HEADS, HEAD_DIM)).astype(np.float32)
    kv, scales = [], []
    for _ in range(2):
        x = rng.standard_normal((int(cu_k[-1]), KV_HEADS, HEAD_DIM))
        x *= 10.0 ** rng.uniform(-2, 1, (x.shape[0], KV_HEADS, 1))
        values, scale = kv_quant.quantize(torch.tensor(x), torch.float8_e4m3fn)
        kv.append(_jax(values))
        scales.append(_jax(scale.T.contiguous()))  # [Hkv, N]
    args = (jnp.asarray(q), *kv, jnp.asarray(cu_q), jnp.asarray(cu_k))
    kwargs = {"k_scales": scales[0], "v_scales": scales[1], "causal": True}
    out = ragged.jax.ragged_attention(
        *args, **kwargs, implementation="pallas", block_q=32, block_k=128
    )
    reference = ragged.jax.ragged_attention(*args, **kwargs, implementation="xla")
    error = float(jnp.abs(out - reference).max() / jnp.abs(reference).max())
    assert error < 1e-5, f"pallas vs reference: {error:.2e} of the largest output"
    dequantized = [
        np.asarray(v, np.float64) * np.asarray(s, np.float64).T[..., None]
        for v, s in zip(kv, scales, strict=True)
    ]
    with jax.enable_x64(True):
        exact = np.asarray(
            ragged.jax.ragged_attention(
                jnp.asarray(q, jnp.float64), *dequantized, cu_q, cu_k, implementation="xla"
            )
        )
    error = float(np.abs(np.asarray(reference) - exact).max() / np.abs(exact).max())
    assert error < 1e-5, f"reference vs float64 on the dequantized keys: {error:.2e}"


def test_8bit_pages_need_scales_and_bad_dtypes_are_named(ragged):
    q, pages, scales, table, lens = _quantized_batch(ragged, "int8")
    torch_args = (torch.tensor(q), *pages, torch.tensor(table), torch.tensor(lens))
    needs = "int8 k_pages need k_scales and v_scales; valid k_pages dtypes"
    with pytest.raises(KernelInputError, match=needs):
        ragged.paged_attention(*torch_args)
    wrong = scales[0].transpose(1, 2)  # [P, page, Hkv]
    with pytest.raises(KernelInputError, match=r"k_scales \(11, 32, 2\) must be \[P, Hkv, page\]"):
        ragged.paged_attention(*torch_args, k_scales=wrong, v_scales=scales[1])
    half = [p.to(torch.float16) for p in pages]
    with pytest.raises(KernelInputError, match=re.escape("k_pages are float16, the query float32")):
        ragged.paged_attention(torch_args[0], *half, *torch_args[3:])
    with pytest.raises(KernelInputError, match="valid: float8_e4m3fn, int8"):
        ragged.jax.kv_quant.kv_cache_dtype("float16")
