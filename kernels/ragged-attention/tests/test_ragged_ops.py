"""Ragged and paged attention (Pallas in interpret mode, and XLA) against a float64 reference.

Batches mix chunked prefill (queries after a cached past), decode (one query), zero-length
sequences and padding tokens; paged tables have -1 entries after each sequence's pages.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

SPECS = {
    "causal": {},
    "window": {"sliding_window": 3},
    "softcap-sinks": {"softcap": 4.0, "sinks": True},
    "window-softcap-scale": {"sliding_window": 5, "softcap": 2.0, "scale": 0.3},
}
TOLERANCE = 1e-5


def ragged_batch(rng, q_heads=4, kv_heads=2, head_dim=16):
    """(arrays, lengths): past/new lengths mixing prefill chunks, decode and empty sequences,
    plus padding tokens and keys past the last offsets."""
    new = np.array([1, 7, 0, 3, 1, 5])
    past = np.array([9, 0, 4, 17, 0, 2])
    order = rng.permutation(len(new))
    new, past = new[order], past[order]
    cu_q = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(new + past)]).astype(np.int32)
    tokens, keys = int(cu_q[-1]) + 3, int(cu_k[-1]) + 5
    q = rng.standard_normal((tokens, q_heads, head_dim))
    k = rng.standard_normal((keys, kv_heads, head_dim))
    v = rng.standard_normal((keys, kv_heads, head_dim))
    sinks = rng.standard_normal(q_heads)
    return q, k, v, cu_q, cu_k, sinks


def _split(options):
    options = dict(options)
    return options.pop("sinks", False), options


def _f64_reference(fn, arrays, options):
    with jax.enable_x64(True):
        arrays = [None if a is None else jnp.asarray(a) for a in arrays]
        return np.asarray(fn(*arrays, implementation="xla", **options))


def _f32(arrays):
    return [
        jnp.asarray(a, jnp.float32) if a.dtype == np.float64 else jnp.asarray(a) for a in arrays
    ]


@pytest.mark.parametrize("implementation", ["pallas", "xla"])
@pytest.mark.parametrize("spec", list(SPECS))
def test_ragged_matches_float64(ragged, implementation, spec):
    with_sinks, options = _split(SPECS[spec])
    rng = np.random.default_rng(len(spec))
    q, k, v, cu_q, cu_k, sinks = ragged_batch(rng)
    arrays = [q, k, v, cu_q, cu_k, sinks if with_sinks else None]
    expected = _f64_reference(ragged.jax.ragged_attention, arrays, options)
    blocks = {"block_q": 8, "block_k": 16} if implementation == "pallas" else {}
    out = ragged.jax.ragged_attention(
        *_f32(arrays[:5]),
        None if arrays[5] is None else jnp.asarray(sinks, jnp.float32),
        implementation=implementation,
        **blocks,
        **options,
    )
    error = np.abs(np.asarray(out) - expected).max()
    assert error < TOLERANCE, f"max abs error {error:.2e}"
    padding = slice(int(cu_q[-1]), None)
    assert not np.asarray(out)[padding].any(), "padding tokens must give zeros"


def test_ragged_reference_matches_a_loop(ragged):
    """The reference itself, against one softmax per (query, head) written out in numpy."""
    rng = np.random.default_rng(7)
    q, k, v, cu_q, cu_k, _ = ragged_batch(rng)
    window = 4
    with jax.enable_x64(True):
        out = np.asarray(
            ragged.jax.ragged_attention(
                q, k, v, cu_q, cu_k, implementation="xla", sliding_window=window
            )
        )
    expected = np.zeros_like(q)
    groups = q.shape[1] // k.shape[1]
    for s in range(len(cu_q) - 1):
        q_len, k_len = cu_q[s + 1] - cu_q[s], cu_k[s + 1] - cu_k[s]
        for i in range(q_len):
            position = k_len - q_len + i
            keys = [j for j in range(k_len) if 0 <= position - j < window]
            for h in range(q.shape[1]):
                kh = h // groups
                rows = cu_k[s] + np.array(keys)
                scores = k[rows, kh] @ q[cu_q[s] + i, h] / 4.0
                p = np.exp(scores - scores.max())
                expected[cu_q[s] + i, h] = (p / p.sum()) @ v[rows, kh]
    assert np.abs(out - expected).max() < 1e-12


def paged_batch(rng, q_heads=4, kv_heads=2, head_dim=16, page=4, num_pages=24, max_pages=6):
    """Decode over a paged cache: shuffled pages, -1 after each sequence's pages, an empty
    (padding) sequence and a sequence filling its table."""
    lens = np.array([5, 0, 16, 1, 9, 24], np.int32)
    table = -np.ones((len(lens), max_pages), np.int32)
    free = list(rng.permutation(num_pages))
    for s, length in enumerate(lens):
        for j in range(-(-length // page)):
            table[s, j] = free.pop()
    q = rng.standard_normal((len(lens), q_heads, head_dim))
    pages = [rng.standard_normal((num_pages, page, kv_heads, head_dim)) for _ in range(2)]
    return q, pages[0], pages[1], table, lens, rng.standard_normal(q_heads)


@pytest.mark.parametrize(
    ("spec", "pages_per_block"),
    [("causal", 1), ("window", 4), ("softcap-sinks", 1), ("window-softcap-scale", 4)],
)
def test_paged_matches_float64(ragged, spec, pages_per_block):
    with_sinks, options = _split(SPECS[spec])
    rng = np.random.default_rng(pages_per_block + len(spec))
    q, k_pages, v_pages, table, lens, sinks = paged_batch(rng)
    arrays = [q, k_pages, v_pages, table, lens, sinks if with_sinks else None]
    expected = _f64_reference(ragged.jax.paged_attention, arrays, options)
    out = ragged.jax.paged_attention(
        *_f32(arrays[:5]),
        None if arrays[5] is None else jnp.asarray(sinks, jnp.float32),
        implementation="pallas",
        pages_per_block=pages_per_block,
        **options,
    )
    error = np.abs(np.asarray(out) - expected).max()
    assert error < TOLERANCE, f"max abs error {error:.2e}"
    assert not np.asarray(out)[lens == 0].any(), "a zero-length sequence must give zeros"


def test_paged_reference_equals_ragged_reference_on_gathered_keys(ragged):
    """Paged decode is ragged decode over the pages each table row names."""
    rng = np.random.default_rng(3)
    q, k_pages, v_pages, table, lens, _ = paged_batch(rng)
    page = k_pages.shape[1]

    def gathered(pages):
        rows = [pages[table[s, j]] for s, n in enumerate(lens) for j in range(-(-n // page))]
        per_seq = np.concatenate(rows)
        starts = np.concatenate([[0], np.cumsum(-(-lens // page) * page)])
        keep = np.concatenate([np.arange(starts[s], starts[s] + n) for s, n in enumerate(lens)])
        return per_seq[keep]

    cu_q = np.concatenate([[0], np.cumsum(lens > 0)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    with jax.enable_x64(True):
        paged = ragged.jax.paged_attention(q, k_pages, v_pages, table, lens, implementation="xla")
        packed = ragged.jax.ragged_attention(
            q[lens > 0], gathered(k_pages), gathered(v_pages), cu_q, cu_k, implementation="xla"
        )
    assert np.abs(np.asarray(paged)[lens > 0] - np.asarray(packed)).max() < 1e-12
