"""Pallas (interpret mode) and Tokamax against the plain reference, values and gradients."""

from __future__ import annotations

import dataclasses

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_helpers import (
    GRAD_TOLERANCE,
    TOLERANCE,
    Case,
    assert_close,
    outputs_and_grads,
    upcast,
)
from hypothesis import given, settings

from kernel_hub.errors import NoImplementationError

# One entry per feature; small blocks so every case runs several q and kv blocks.
FEATURES = {
    "causal": (Case(), {"causal": True}),
    "bidirectional-softcap-scale": (Case(), {"softcap": 2.0, "scale": 0.7}),
    "multi-query-key-padding": (Case(q_heads=4, kv_heads=1, kv_mask=True), {"causal": True}),
    "window-causal-ragged": (
        Case(q_len=21, kv_len=37, head_dim=8),
        {"causal": True, "sliding_window": 11},
    ),
    "window-bidirectional": (Case(q_len=40, kv_len=40), {"sliding_window": 7}),
    "segments": (Case(batch=2, segments=True), {"causal": True}),
    # 8 heads x 3 queries > block_q rows: q blocks of whole (padded) head groups.
    "decode-mqa-q3-kv70": (Case(q_heads=8, kv_heads=1, q_len=3, kv_len=70), {"causal": True}),
    "q-longer-than-kv": (Case(q_len=30, kv_len=20, kv_mask=True), {"causal": True}),
    "bf16-gqa-window-softcap": (
        Case(q_len=40, kv_len=40, dtype="bfloat16", kv_mask=True),
        {"causal": True, "sliding_window": 16, "softcap": 5.0},
    ),
}
BLOCKS = {"block_q": 16, "block_k": 16}


@pytest.mark.parametrize("feature", list(FEATURES))
def test_pallas_matches_reference(attention, feature):
    case, options = FEATURES[feature]
    arrays = case.arrays()
    cotangents = case.cotangents()
    api = attention.jax
    got = outputs_and_grads(
        api.dot_product_attention_with_lse,
        arrays,
        cotangents,
        implementation="pallas",
        **BLOCKS,
        **options,
    )
    want = outputs_and_grads(
        api.dot_product_attention_with_lse,
        upcast(arrays),
        tuple(c.astype(jnp.float32) for c in cotangents),
        implementation="xla",
        **options,
    )
    value_tol, grad_tol = TOLERANCE[case.dtype], GRAD_TOLERANCE[case.dtype]
    for name, actual, expected, tol in zip(
        ("out", "lse", "dq", "dk", "dv"),
        got,
        want,
        (value_tol, value_tol, grad_tol, grad_tol, grad_tol),
        strict=True,
    ):
        assert_close(actual, expected, tol, f"{feature} {name}")


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_pallas_head_dims(attention, head_dim):
    case = Case(q_len=20, kv_len=20, head_dim=head_dim, dtype="bfloat16")
    arrays = case.arrays()
    api = attention.jax
    got = _attention(api, arrays, causal=True, implementation="pallas", **BLOCKS)
    want = _attention(api, upcast(arrays), causal=True, implementation="xla")
    assert_close(got, want, TOLERANCE["bfloat16"], f"head_dim {head_dim}")


def test_fully_masked_rows_give_zeros(attention):
    # Batch 0 masks every key; in batch 1 causal queries before the first key see nothing.
    case = Case(batch=2, q_len=30, kv_len=20, kv_mask=True)
    arrays = case.arrays()
    kv_mask = np.asarray(arrays["kv_mask"]).copy()
    kv_mask[0] = False
    arrays["kv_mask"] = jnp.asarray(kv_mask)
    cotangents = case.cotangents()
    out, lse, dq, dk, dv = outputs_and_grads(
        attention.jax.dot_product_attention_with_lse,
        arrays,
        cotangents,
        implementation="pallas",
        causal=True,
        **BLOCKS,
    )
    for name, value in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert not np.isnan(np.asarray(value)).any(), f"{name} has NaN"
    assert np.all(np.asarray(out[0]) == 0), "a batch with every key masked must give zeros"
    assert np.all(np.asarray(lse[0]) == -np.inf)
    empty_rows = 30 - 20  # queries 0..9 sit before key 0
    assert np.all(np.asarray(out[1, :, :empty_rows]) == 0)
    assert np.all(np.isfinite(np.asarray(lse[1, :, empty_rows:])))


@st.composite
def problems(draw):
    kv_heads = draw(st.sampled_from([1, 2]))
    case = Case(
        batch=draw(st.integers(1, 2)),
        kv_heads=kv_heads,
        q_heads=kv_heads * draw(st.sampled_from([1, 3, 4])),
        q_len=draw(st.integers(1, 40)),
        kv_len=draw(st.integers(1, 48)),
        head_dim=draw(st.sampled_from([8, 32])),
        dtype=draw(st.sampled_from(["float32", "bfloat16"])),
        kv_mask=draw(st.booleans()),
        segments=draw(st.booleans()),
    )
    options = {
        "causal": draw(st.booleans()),
        "sliding_window": draw(st.one_of(st.none(), st.integers(1, 24))),
        "softcap": draw(st.one_of(st.none(), st.sampled_from([1.0, 20.0]))),
        "scale": draw(st.one_of(st.none(), st.floats(0.05, 1.5))),
    }
    blocks = {
        "block_q": draw(st.sampled_from([8, 16, 64])),
        "block_k": draw(st.sampled_from([8, 32])),
    }
    return case, options, blocks, draw(st.integers(0, 2**16))


def _attention(api, arrays, **options):
    """One jitted call (eager dispatch of the wrappers costs more than the compile)."""
    return jax.jit(lambda arrays: api.dot_product_attention(**arrays, **options))(arrays)


def _check_values(attention, implementation, case, options, blocks, seed):
    arrays = case.arrays(seed)
    api = attention.jax
    got = _attention(api, arrays, implementation=implementation, **blocks, **options)
    want = _attention(api, upcast(arrays), implementation="xla", **options)
    assert_close(got, want, TOLERANCE[case.dtype], f"{implementation} {case} {options} {blocks}")


@settings(max_examples=8, deadline=None)
@given(problems())
def test_pallas_values_hypothesis(attention, problem):
    _check_values(attention, "pallas", *problem)


@settings(max_examples=6, deadline=None)
@given(problems())
def test_tokamax_values_hypothesis(attention, problem):
    case, options, _, seed = problem
    case = dataclasses.replace(case, dtype="float32")  # bf16 is refused on CPU, see below
    _check_values(attention, "tokamax", case, options, {}, seed)


def test_tokamax_refuses_logsumexp(attention):
    reasons = dict(
        attention.jax.TABLE.explain(
            *Case().arrays().values(),
            None,  # per-token mask arrays (masking.TokenMask)
            None,  # sinks
            spec=attention.jax.AttentionSpec(causal=True).resolved(16),
            with_lse=True,
            implementation="tokamax",
        )
    )
    assert "logsumexp" in reasons["tokamax"]


def test_tokamax_declines_dropout(attention):
    """Tokamax has no dropout: it declines with the reason and the order moves on."""
    spec = attention.jax.AttentionSpec(causal=True, dropout_rate=0.1).resolved(16)
    reasons = dict(
        attention.jax.TABLE.explain(
            *Case().arrays().values(), None, None, spec=spec, with_lse=False,
            implementation="tokamax",
        )
    )  # fmt: skip
    assert "has no attention dropout" in reasons["tokamax"]


@pytest.mark.parametrize("shape", [(0, 2, 128, 64), (2, 0, 128, 64)], ids=["batch", "heads"])
def test_an_empty_batch_or_no_heads_gives_the_empty_result(attention, shape):
    """The kernels decline (no block to run: Pallas raised a raw TypeError from its index maps);
    the table's next implementation, XLA, returns the empty output and gradient, as SDPA does."""
    q = jnp.ones(shape, jnp.float32)
    kv = jnp.ones((shape[0], 2 if shape[1] else 1, 128, 64), jnp.float32)
    with pytest.raises(NoImplementationError, match=r"pallas: an empty batch or no query heads"):
        attention.jax.dot_product_attention(q, kv, kv, causal=True, implementation="pallas")
    out = attention.jax.dot_product_attention(q, kv, kv, causal=True)
    grad = jax.grad(
        lambda a: attention.jax.dot_product_attention_with_lse(a, kv, kv, causal=True)[0].sum()
    )(q)
    assert out.shape == shape and grad.shape == shape
    reasons = dict(
        attention.jax.TABLE.explain(
            q, kv, kv, None, None, spec=attention.jax.AttentionSpec(causal=True).resolved(64),
            with_lse=False, implementation="tokamax",
        )
    )  # fmt: skip
    assert "an empty batch or no query heads" in reasons["tokamax"]


def test_results_do_not_depend_on_block_sizes(attention):
    """Online softmax across many blocks equals one block, values and gradients."""
    case, options = Case(q_len=24, kv_len=24), {"causal": True, "sliding_window": 9}
    arrays, cotangents = case.arrays(), case.cotangents()
    api = attention.jax
    runs = [
        outputs_and_grads(
            api.dot_product_attention_with_lse,
            arrays,
            cotangents,
            implementation="pallas",
            block_q=bq,
            block_k=bk,
            **options,
        )
        for bq, bk in ((8, 8), (32, 32))
    ]
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), *runs, strict=True):
        assert_close(a, b, 1e-5, f"blocks 8 vs 32 {name}")


def test_tokamax_refuses_bf16_on_cpu(attention):
    arrays = Case(dtype="bfloat16").arrays()
    with pytest.raises(NoImplementationError, match="dot algorithm"):
        attention.jax.dot_product_attention(**arrays, implementation="tokamax")


# (q heads, q length, kv length, block_q, block_k, mask options): causal, windowed and plain
# masks over ragged lengths and unequal blocks, so some block pairs are skipped and some clamped
BLOCK_SCHEDULES = [
    (2, 40, 40, 8, 8, {"causal": True}),
    (2, 21, 37, 8, 16, {"causal": True, "sliding_window": 11}),
    (1, 30, 20, 16, 8, {"causal": True, "sliding_window": 4}),
    (3, 40, 40, 16, 8, {"sliding_window": 7}),
    (8, 3, 70, 16, 16, {"causal": True, "sliding_window": 20}),
]
SCHEDULE_PARAMS = ("q_heads", "q_len", "kv_len", "block_q", "block_k", "options")


@pytest.mark.parametrize(SCHEDULE_PARAMS, BLOCK_SCHEDULES)
def test_visited_blocks_are_exactly_the_needed_ones(
    attention, q_heads, q_len, kv_len, block_q, block_k, options
):
    """Block skipping visits every block holding a visible pair and no other; the clamped index
    maps fetch the block being computed."""
    pallas_tpu, masking = attention.jax.pallas_tpu, attention.jax.masking
    spec = masking.AttentionSpec(**options)
    layout = pallas_tpu.make_layout(
        (1, q_heads, q_len, 16), (1, 1, kv_len, 16), pallas_tpu.BlockSizes(block_q, block_k)
    )
    visible_pairs = np.asarray(masking.dense_mask(q_len, kv_len, spec)[0, 0])
    for qi in range(layout.num_q_blocks):
        rows = np.asarray(layout.query_index(qi, (layout.block_q, 1)))[:, 0]
        rows = rows[rows < q_len]
        for ki in range(layout.num_k_blocks):
            keys = slice(ki * layout.block_k, (ki + 1) * layout.block_k)
            needed = bool(visible_pairs[rows, keys].any())
            assert bool(layout.visible(qi, ki, spec)) == needed, (qi, ki)
            if needed:
                assert int(layout.clamped_key_block(qi, ki, spec)) == ki, (qi, ki)
                assert int(layout.clamped_query_block(qi, ki, spec)) == qi, (qi, ki)


@pytest.mark.parametrize(
    SCHEDULE_PARAMS,
    # and a mask that skips nothing, a causal one with fewer queries than one block, and q
    # blocks past 512 rows with ragged tails (the default blocks of a call with no mask)
    [
        *BLOCK_SCHEDULES,
        (2, 48, 48, 16, 16, {}),
        (8, 3, 16, 16, 16, {"causal": True}),
        (2, 1300, 700, 1024, 256, {}),
        (2, 1300, 1300, 1024, 256, {"causal": True}),
    ],
)
def test_declared_cost_is_the_block_schedule(
    attention, q_heads, q_len, kv_len, block_q, block_k, options
):
    """Each kernel's pl.CostEstimate (all cost_analysis() sees of it) is its block schedule:
    bytes as the pipeline moves them (block_schedule walks the grid's index maps: K and V once
    per q block that reaches them, q/do once per kv block for dk/dv) and the matmuls of every
    block pair holding a visible (query, key) pair, whole tiles (a causal diagonal and padded
    rows included, as the MXU runs them)."""
    from kernel_hub.bench import block_schedule

    pallas_tpu, masking = attention.jax.pallas_tpu, attention.jax.masking
    batch, kv_heads, d = 2, 1, 16
    q, k, v = Case(batch, q_heads, kv_heads, q_len, kv_len, d).arrays().values()

    def loss(q, k, v):
        out, lse = attention.jax.dot_product_attention_with_lse(
            q, k, v, implementation="pallas", block_q=block_q, block_k=block_k, **options
        )
        return jnp.sum(out) + jnp.sum(lse)

    calls = block_schedule.pallas_calls(jax.grad(loss, argnums=(0, 1, 2)), q, k, v)
    layout = pallas_tpu.make_layout(
        q.shape, k.shape, pallas_tpu.BlockSizes(block_q, block_k), value_dim=d
    )
    spec = masking.AttentionSpec(**options)
    visible = sum(
        bool(layout.visible(qi, ki, spec))
        for qi in range(layout.num_q_blocks)
        for ki in range(layout.num_k_blocks)
    )
    tile = batch * kv_heads * visible * layout.block_q * layout.block_k
    matmul_dims = {  # q.k, p.v; q.k, do.v, ds.k; q.k, do.v, p.do, ds.q
        "flash_attention_forward": 2 * d,
        "flash_attention_backward_dq": 3 * d,
        "flash_attention_backward_dkv": 4 * d,
    }
    assert [c.params["name"] for c in calls] == list(matmul_dims)
    for call in calls:
        name, declared = call.params["name"], call.params["cost_estimate"]
        assert declared.bytes_accessed == block_schedule.bytes_moved(call), name
        assert declared.flops == 2 * matmul_dims[name] * tile, name


def test_default_blocks_do_not_pad_a_length_they_can_divide(attention):
    """Flux's 768 tokens (256 x 256 px) run in 384-row blocks, not padded to 1,024 by 512-row
    ones; a length no multiple of 128 of at least half the block divides is padded as before."""
    pallas_tpu = attention.jax.pallas_tpu
    caps = pallas_tpu.KernelBlocks(*[pallas_tpu.BlockSizes(512, 512)] * 2)
    for length, block, padded in ((768, 384, 768), (4608, 512, 4608), (640, 512, 1024)):
        blocks = pallas_tpu.unpadded(caps, length, length)
        assert blocks.forward == blocks.backward == pallas_tpu.BlockSizes(block, block)
        shape = (1, 2, length, 128)
        layout = pallas_tpu.make_layout(shape, shape, blocks.forward)
        assert (layout.q_len_padded, layout.kv_len_padded) == (padded, padded), length


# Flux's joint attention at 1024 x 1024 px: 24 heads of 128 over 4,608 tokens, no mask. Forward
# and backward (q, k) blocks by generation: the forward reads K and V once per q block (3 times
# at 1,536 rows, 6 at 768, was 9 at 512), dq K and V once per q block and dk/dv q and dO once
# per kv block (6 times each at 768, was 9).
GROWN_BLOCKS = {
    "v4": ((768, 256), (512, 512)),
    "v5e": ((1536, 512), (768, 768)),
    "v5p": ((1536, 512), (768, 768)),
    "v6e": ((1536, 512), (768, 768)),
}


@pytest.mark.parametrize("generation", list(GROWN_BLOCKS))
def test_default_blocks_grow_where_every_block_pair_is_visited(attention, generation):
    """Without a mask the block schedule skips nothing, so larger q blocks cut K/V re-reads at
    the same FLOPs: the default blocks grow past 512 rows within the generation's VMEM; a
    masked call (causal, window or per-token: larger q blocks would compute more masked tiles)
    keeps the 512-row blocks of before, whatever the generation."""
    from kernel_hub.kernel_api import tiling

    pallas_tpu = attention.jax.pallas_tpu
    shape, length = (1, 24, 4608, 128), 4608

    def blocks(**options):
        chosen = pallas_tpu.default_blocks(
            shape, shape, jnp.bfloat16, interpret=False, generation=generation, **options
        )
        return pallas_tpu.unpadded(chosen, length, length)

    grown = blocks(every_pair=True)
    assert ((grown.forward.q, grown.forward.k), (grown.backward.q, grown.backward.k)) == (
        GROWN_BLOCKS[generation]
    )
    budget = tiling.vmem_budget(generation, reserve=6 << 20)
    for kernel_blocks, vmem in (
        (grown.forward, pallas_tpu._forward_vmem_bytes),
        (grown.backward, pallas_tpu._backward_vmem_bytes),
    ):
        assert vmem(kernel_blocks.q, kernel_blocks.k, (128, 128), 2) <= budget
    masked = blocks(every_pair=False)
    assert masked.forward == masked.backward == pallas_tpu.BlockSizes(512, 512)


@pytest.mark.parametrize(
    "options, case",
    [
        ({}, Case(q_len=1300, kv_len=700)),
        ({"causal": True}, Case(q_len=1300, kv_len=1300)),
        ({"causal": True}, Case(batch=2, q_len=1300, kv_len=700, kv_mask=True, segments=True)),
    ],
    ids=["every-pair", "causal", "segments-key-padding"],
)
def test_blocks_past_512_rows_match_reference(attention, monkeypatch, options, case):
    """Default blocks as the TPU may now choose them, past 512 rows and not powers of two:
    640-row forward q blocks (1,300 queries of 4 heads over 2 kv heads: each head padded to
    1,920, the third block ragged) by 256 keys, and 768 x 384 for the backward, against the XLA
    reference, values and gradients."""
    pallas_tpu = attention.jax.pallas_tpu
    grown = pallas_tpu.KernelBlocks(
        pallas_tpu.BlockSizes(640, 256), pallas_tpu.BlockSizes(768, 384)
    )
    monkeypatch.setattr(pallas_tpu, "default_blocks", lambda *args, **kwargs: grown)
    arrays, cotangents = case.arrays(), case.cotangents()
    api = attention.jax
    got = outputs_and_grads(
        api.dot_product_attention_with_lse, arrays, cotangents, implementation="pallas", **options
    )
    want = outputs_and_grads(
        api.dot_product_attention_with_lse, arrays, cotangents, implementation="xla", **options
    )
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want, strict=True):
        tolerance = TOLERANCE if name in ("out", "lse") else GRAD_TOLERANCE
        assert_close(a, b, tolerance[case.dtype], f"{name}")


def test_row_statistics_reach_hbm_lane_dense(attention):
    """No floating operand or result of the forward and backward kernels is a one-lane column
    ([..., rows, 1]): in HBM such a column takes a 128-lane tile per row (the logsumexp was
    256 MiB for 2 MiB of content at batch 2 x 8192 with Llama-3-8B heads)."""
    from kernel_hub.bench.block_schedule import pallas_calls

    case = Case(q_len=40, kv_len=40)
    q, k, v = (case.arrays()[name] for name in ("query", "key", "value"))

    def loss(q, k, v):
        out, lse = attention.jax.dot_product_attention_with_lse(
            q, k, v, causal=True, implementation="pallas", **BLOCKS
        )
        return jnp.sum(out) + jnp.sum(lse)

    calls = pallas_calls(jax.grad(loss, argnums=(0, 1, 2)), q, k, v)
    assert len(calls) == 3  # forward, dq, dk and dv
    for call in calls:
        mapping = call.params["grid_mapping"]
        for block in mapping.block_mappings:
            shape, dtype = block.array_aval.shape, block.array_aval.dtype
            if jnp.issubdtype(dtype, jnp.floating):
                assert shape[-1] != 1, f"{call.params['name']}: a [..., {shape[-2]}, 1] column"


# Decode over a cache whose head dim leaves lanes empty (GPT-OSS: 64 q / 8 kv heads of 64, sinks,
# a 128-token window on alternate layers) in 128-key blocks: 3-4 kv blocks, key padding, and a
# length the blocks pad (300 -> 384).
DECODE_OPTIONS = {
    "causal": {"causal": True},
    "window": {"causal": True, "sliding_window": 200},
}


@pytest.mark.parametrize("options", list(DECODE_OPTIONS))
@pytest.mark.parametrize("q_len, kv_len", [(1, 512), (4, 300)])
def test_decode_reads_a_lane_padded_cache_transposed(attention, q_len, kv_len, options):
    """The forward reads a decode step's K and V of head dim 64 as [B, Hkv, 64, Sk]
    (``SequenceMinor``: a bitcast of the layout TPU gives such a cache), with or without the
    logsumexp (eager-attention models read it to find rows that see no key), and gives the
    reference's values; at head dim 128 it reads [B, Hkv, Sk, D] as before."""
    from kernel_hub.bench import block_schedule

    api = attention.jax
    arrays = Case(2, 16, 2, q_len, kv_len, 64, dtype="bfloat16", kv_mask=True).arrays()
    arrays["sinks"] = jnp.asarray(np.random.default_rng(3).standard_normal(16), jnp.bfloat16)
    blocks = {"block_q": 128, "block_k": 128}
    options = DECODE_OPTIONS[options]
    got = _attention(api, arrays, implementation="pallas", **blocks, **options)
    want = _attention(api, upcast(arrays), implementation="xla", **options)
    assert_close(got, want, TOLERANCE["bfloat16"], f"decode {q_len} x {kv_len}")

    def kv_operands(function, arrays):
        (call,) = block_schedule.pallas_calls(
            lambda: function(**arrays, implementation="pallas", **blocks, **options)
        )
        return [m.array_aval.shape for m in call.params["grid_mapping"].block_mappings[1:3]]

    padded = -(-kv_len // 128) * 128
    assert kv_operands(api.dot_product_attention, arrays) == [(2, 2, 64, padded)] * 2
    assert kv_operands(api.dot_product_attention_with_lse, arrays) == [(2, 2, 64, padded)] * 2
    got = jax.jit(
        lambda a: api.dot_product_attention_with_lse(
            **a, implementation="pallas", **blocks, **options
        )
    )(arrays)
    want = jax.jit(
        lambda a: api.dot_product_attention_with_lse(**a, implementation="xla", **options)
    )(upcast(arrays))
    for name, actual, expected in zip(("out", "lse"), got, want, strict=True):
        assert_close(actual, expected, TOLERANCE["bfloat16"], f"decode {name} with the lse")
    wide = Case(2, 16, 2, q_len, kv_len, 128, dtype="bfloat16").arrays()
    assert kv_operands(api.dot_product_attention, wide) == [(2, 2, padded, 128)] * 2
