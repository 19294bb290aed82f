"""Value parity of the fused experts (Pallas in interpret mode at TPU block sizes, and XLA) with
a float64 oracle over ragged routings, layouts, activations, biases and dtypes; routing parity
with its definition."""

from __future__ import annotations

import fused_moe_oracle as oracle
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_hub import get_kernel

fused = get_kernel("fused-moe")
api = fused.jax
Blocks = api.Blocks
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}
E, H, INTER = 6, 256, 512
# Several blocks per grid axis: ti=128 gives 4 steps over I; tm=16 gives several chunks.
BLOCKS = Blocks(tm=16, ti=128)


def routing(kind: str, tokens: int, top_k: int, rng) -> np.ndarray:
    """[T, k] distinct expert ids: spread at random, expert 2 left empty, all on expert 0 (top-1),
    or padding rows (-1) and out-of-range sentinels mixed in."""
    if kind == "one_expert":
        return np.zeros((tokens, top_k), np.int32) + np.arange(top_k, dtype=np.int32)
    pool = [e for e in range(E) if kind != "empty_expert" or e != 2]
    ids = np.stack([rng.choice(pool, top_k, replace=False) for _ in range(tokens)])
    if kind == "sentinels":
        ids[::3, 0] = -1
        ids[1::4, -1] = E
    return ids.astype(np.int32)


def weights_for(transposed: bool, rng, dtype):
    w1 = rng.standard_normal((E, H, 2 * INTER) if transposed else (E, 2 * INTER, H)) / np.sqrt(H)
    w2 = rng.standard_normal((E, INTER, H) if transposed else (E, H, INTER)) / np.sqrt(INTER)
    return w1.astype(np.float32).astype(dtype), w2.astype(np.float32).astype(dtype)


def check(got, expected, dtype):
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    scale = max(np.abs(expected).max(), 1.0)
    err = np.abs(got - expected).max()
    assert err <= TOLERANCE[jnp.dtype(dtype).name] * scale, f"max error {err:.3g} (scale {scale})"


@pytest.mark.parametrize("implementation", ["pallas", "xla"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
    "kind,tokens,top_k",
    [("spread", 40, 2), ("empty_expert", 24, 3), ("one_expert", 20, 1), ("spread", 1, 2),
     ("sentinels", 24, 2)],
)  # fmt: skip
def test_silu_experts_match_oracle(implementation, dtype, kind, tokens, top_k):
    rng = np.random.default_rng(tokens + top_k)
    x = rng.standard_normal((tokens, H)).astype(np.float32).astype(dtype)
    ids = routing(kind, tokens, top_k, rng)
    w = rng.random((tokens, top_k)).astype(np.float32)
    w1, w2 = weights_for(False, rng, dtype)
    blocks = BLOCKS if implementation == "pallas" else None
    got = api.fused_experts(x, ids, w, w1, w2, implementation=implementation, blocks=blocks)
    assert got.dtype == dtype and got.shape == (tokens, H)
    check(got, oracle.experts(x, ids, w, w1, w2), dtype)


@pytest.mark.parametrize("implementation", ["pallas", "xla"])
@pytest.mark.parametrize(
    "activation,transposed,interleaved,bias",
    [("gpt_oss", True, True, True), ("gelu", False, False, False),
     ("gelu_tanh", True, False, True), ("silu", False, True, False)],
)  # fmt: skip
def test_layouts_activations_and_biases(implementation, activation, transposed, interleaved, bias):
    rng = np.random.default_rng(7)
    tokens, top_k = 24, 2
    x = rng.standard_normal((tokens, H)).astype(np.float32)
    ids = routing("empty_expert", tokens, top_k, rng)
    w = rng.random((tokens, top_k)).astype(np.float32)
    w1, w2 = weights_for(transposed, rng, np.float32)
    b1 = rng.standard_normal((E, 2 * INTER)).astype(np.float32) if bias else None
    b2 = rng.standard_normal((E, H)).astype(np.float32) if bias else None
    blocks = Blocks(tm=8, ti=64 if interleaved and transposed else 128)
    got = api.fused_experts(
        x, ids, w, w1, w2, b1, b2, activation=activation, transposed=transposed,
        interleaved=interleaved, implementation=implementation,
        blocks=blocks if implementation == "pallas" else None,
    )  # fmt: skip
    expected = oracle.experts(x, ids, w, w1, w2, b1, b2, activation=activation,
                              transposed=transposed, interleaved=interleaved)  # fmt: skip
    check(got, expected, np.float32)


@pytest.mark.slow
@pytest.mark.parametrize("implementation", ["pallas", "xla"])
@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_quantized_weights_match_dequantized_oracle(implementation, quantization):
    """W8A16: the oracle multiplies the bf16 activations by the dequantized weights in f64."""
    rng = np.random.default_rng(3)
    tokens, top_k = 32, 2
    x = rng.standard_normal((tokens, H)).astype(np.float32).astype(jnp.bfloat16)
    ids = routing("empty_expert", tokens, top_k, rng)
    w = rng.random((tokens, top_k)).astype(np.float32)
    w1, w2 = weights_for(False, rng, np.float32)
    q1, s1 = fused.quant.quantize(jnp.asarray(w1), quantization)
    q2, s2 = fused.quant.quantize(jnp.asarray(w2), quantization)
    blocks = Blocks(tm=16, ti=128)  # several steps: each picks its own scale blocks
    got = api.fused_experts(
        x, ids, w, q1, q2, None, None, s1, s2, quantization=quantization,
        implementation=implementation, blocks=blocks if implementation == "pallas" else None,
    )  # fmt: skip
    d1 = np.asarray(fused.quant.dequantize(q1, s1, quantization, jnp.float32), np.float64)
    d2 = np.asarray(fused.quant.dequantize(q2, s2, quantization, jnp.float32), np.float64)
    check(got, oracle.experts(x, ids, w, d1, d2), jnp.bfloat16)


def test_quantization_error_is_small_but_not_zero():
    rng = np.random.default_rng(4)
    w = jnp.asarray(rng.standard_normal((2, 256, 384)), jnp.float32)
    for kind, bound in (("int8", 0.01), ("fp8", 0.05)):
        q, s = fused.quant.quantize(w, kind)
        back = fused.quant.dequantize(q, s, kind, jnp.float32)
        rel = float(jnp.linalg.norm(back - w) / jnp.linalg.norm(w))
        assert 0 < rel < bound, (kind, rel)


def test_prefill_takes_the_xla_path_with_the_reason():
    """More tokens than the kernel holds in VMEM (a decode step) run the XLA path."""
    rng = np.random.default_rng(5)
    tokens, top_k, hidden, inter = api.MAX_TOKENS + 40, 2, 128, 128
    x = jnp.asarray(rng.standard_normal((tokens, hidden)), jnp.float32)
    ids = jnp.asarray(np.stack([rng.choice(4, 2, replace=False) for _ in range(tokens)]),
                      jnp.int32)  # fmt: skip
    w = jnp.asarray(rng.random((tokens, top_k)), jnp.float32)
    w1 = jnp.zeros((4, 2 * inter, hidden), jnp.float32)
    w2 = jnp.zeros((4, hidden, inter), jnp.float32)
    kwargs = dict(config=fused.jax.ExpertsConfig(), out_dtype=jnp.float32, blocks=None)
    verdicts = dict(api.TABLE.explain(x, ids, w, w1, w2, None, None, None, None, **kwargs))
    assert "prefill runs the sorted ragged_dot path" in verdicts["pallas"]
    assert verdicts["xla"] is None


@pytest.mark.slow
def test_float64_in_interpret_mode():
    rng = np.random.default_rng(6)
    with jax.enable_x64(True):
        x = rng.standard_normal((8, H))
        ids = routing("spread", 8, 2, rng)
        w = rng.random((8, 2))
        w1, w2 = weights_for(False, rng, np.float64)
        for impl in ("pallas", "xla"):
            blocks = Blocks(8, 128) if impl == "pallas" else None
            got = api.fused_experts(x, ids, w, w1, w2, implementation=impl, blocks=blocks)
            assert got.dtype == jnp.float64
            np.testing.assert_allclose(got, oracle.experts(x, ids, w, w1, w2), atol=1e-10)


@pytest.mark.parametrize(
    "router",
    [dict(scoring="softmax", renormalize=True), dict(scoring="softmax", renormalize=False),
     dict(scoring="sigmoid", renormalize=True, groups=4, top_groups=2, scale=2.5),
     dict(scoring="sigmoid", renormalize=False, groups=8, top_groups=3)],
)  # fmt: skip
@pytest.mark.parametrize("with_bias", [False, True])
def test_routing_matches_definition(router, with_bias):
    rng = np.random.default_rng(8)
    experts, top_k = 16, 4
    logits = rng.standard_normal((12, experts)).astype(np.float32)
    bias = rng.standard_normal(experts).astype(np.float32) * 0.3 if with_bias else None
    spec = fused.routing.Router(top_k, **router)
    weights, ids = fused.routing.route(jnp.asarray(logits), spec, bias)
    expected_w, expected_ids = oracle.route(logits, top_k, bias=bias, **router)
    np.testing.assert_array_equal(np.asarray(ids), expected_ids)
    np.testing.assert_allclose(np.asarray(weights), expected_w, rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_fused_moe_routes_then_runs_the_experts():
    rng = np.random.default_rng(9)
    tokens, experts = 16, 8
    x = rng.standard_normal((tokens, H)).astype(np.float32)
    logits = rng.standard_normal((tokens, experts)).astype(np.float32)
    bias = rng.standard_normal(experts).astype(np.float32) * 0.1
    w1 = (rng.standard_normal((experts, 2 * INTER, H)) / 16).astype(np.float32)
    w2 = (rng.standard_normal((experts, H, INTER)) / 22).astype(np.float32)
    router = dict(scoring="sigmoid", groups=4, top_groups=2, scale=2.5)
    got = api.fused_moe(x, logits, w1, w2, routing_bias=bias, top_k=2, routed_scale=2.5,
                        scoring="sigmoid", groups=4, top_groups=2, implementation="pallas",
                        blocks=BLOCKS)  # fmt: skip
    weights, ids = oracle.route(logits, 2, bias=bias, **router)
    check(got, oracle.experts(x, ids, weights, w1, w2), np.float32)


def _w8a8_oracle(x, ids, weights, w1, w2):
    """float64 W8A8: the rows and the activation fake-quantized per token and 128 columns, times
    the dequantized int8 weights."""

    def fake_quantize(v):
        groups = v.reshape(-1, 128)
        scale = np.abs(groups).max(axis=1, keepdims=True) / 127
        scale[scale == 0] = 1
        return (np.clip(np.round(groups / scale), -127, 127) * scale).reshape(v.shape)

    x = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for s in range(ids.shape[1]):
            e = int(ids[t, s])
            h = w1[e] @ fake_quantize(x[t])
            gate, up = np.split(h, 2)
            act = gate / (1 + np.exp(-gate)) * up
            out[t] += weights[t, s] * (w2[e] @ fake_quantize(act))
    return out


@pytest.mark.parametrize(
    "implementation,dtype",
    [("pallas", jnp.float32), ("pallas", jnp.bfloat16), ("xla", jnp.bfloat16)],
)
def test_w8a8_matches_its_float64_oracle_and_reports_error(implementation, dtype):
    """Activations quantized per token and 128 columns in the kernel (int8 x int8 -> int32);
    the error against unquantized activations is printed, not hidden."""
    rng = np.random.default_rng(11)
    tokens, top_k = 24, 2
    x = rng.standard_normal((tokens, H)).astype(np.float32).astype(dtype)
    ids = routing("empty_expert", tokens, top_k, rng)
    w = rng.random((tokens, top_k)).astype(np.float32)
    w1, w2 = weights_for(False, rng, np.float32)
    q1, s1 = fused.quant.quantize(jnp.asarray(w1), "w8a8")
    q2, s2 = fused.quant.quantize(jnp.asarray(w2), "w8a8")
    got = api.fused_experts(
        x, ids, w, q1, q2, None, None, s1, s2, quantization="w8a8",
        implementation=implementation, blocks=BLOCKS if implementation == "pallas" else None,
    )  # fmt: skip
    d1 = np.asarray(fused.quant.dequantize(q1, s1, "int8", jnp.float32), np.float64)
    d2 = np.asarray(fused.quant.dequantize(q2, s2, "int8", jnp.float32), np.float64)
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    expected = _w8a8_oracle(x, ids, w, d1, d2)
    scale = np.abs(expected).max()
    # f32: only rounding ties may flip a quantized value; bf16 adds its output rounding
    assert np.abs(got - expected).max() <= (2e-3 if dtype == jnp.float32 else 1e-2) * scale
    w8a16 = oracle.experts(x, ids, w, d1, d2)
    error = np.abs(got - w8a16).max() / scale
    print(f"w8a8 {implementation} {jnp.dtype(dtype).name}: max error vs W8A16 {error:.3g}")
    assert 0 < error < 0.05


def test_declared_flops_are_the_rows_the_kernel_multiplies():
    """The Pallas call's declared FLOPs (all cost_analysis() sees of it) are the matmuls of the
    tm-row chunks it multiplies (gate/up and down, 2 x rows x H x 3I; the selection matmuls that
    gather and scatter them, 4 x rows x T x H) at the most chunks T x k pairs can make
    (``padded_rows``): 19 tokens on experts (0, 1) 17 times and (2, 3), (4, 5) once make that
    many (8 chunks: 2 + 2 + 4 x 1), as the dispatch counts them; a random routing makes fewer."""
    from kernel_hub.bench.block_schedule import pallas_calls

    rng = np.random.default_rng(0)
    tokens, top_k = 19, 2
    w1, w2 = (jnp.asarray(w) for w in weights_for(False, rng, np.float32))
    x = jnp.asarray(rng.standard_normal((tokens, H)), jnp.float32)
    weights = jnp.full((tokens, top_k), 0.5, jnp.float32)
    dispatch = api.pallas_tpu.dispatch

    def declared_and_counted(ids):
        ids = jnp.asarray(ids)
        (call,) = pallas_calls(
            lambda: api.fused_experts(
                x, ids, weights, w1, w2, implementation="pallas", blocks=BLOCKS
            )
        )
        plan = dispatch(ids, weights, E, BLOCKS.tm, INTER // BLOCKS.ti)
        rows = int(np.sum(plan.chunks)) * BLOCKS.tm
        counted = 2 * rows * H * 3 * INTER + 4 * rows * tokens * H
        return call.params["cost_estimate"].flops, counted, rows

    most = np.array([[0, 1]] * 17 + [[2, 3], [4, 5]], np.int32)
    declared, counted, rows = declared_and_counted(most)
    assert rows == 8 * BLOCKS.tm and declared == counted
    declared, counted, rows = declared_and_counted(routing("spread", tokens, top_k, rng))
    assert rows < 8 * BLOCKS.tm and declared > counted
