"""MXFP4 (GPT-OSS's checkpoint format) expert weights: the decode against Transformers' own, and
the fused experts (Pallas in interpret mode at TPU block sizes, and XLA) against a float64 oracle
that decodes the bytes with Transformers' e2m1 table, over ragged routings."""

from __future__ import annotations

import fused_moe_oracle as oracle
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_hub import get_kernel
from kernel_hub.errors import KernelInputError

fused = get_kernel("fused-moe")
api, quant = fused.jax, fused.quant
E, H, INTER = 6, 256, 512
# ti=256: two steps over I, and a 128-byte down block (the smallest legal mxfp4 one)
BLOCKS = api.Blocks(tm=16, ti=256)
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}
FP4 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def decode(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float64 [E, out, in] of packed [E, out, in / 2] bytes: low nibble first."""
    values = np.empty((*blocks.shape[:-1], 2 * blocks.shape[-1]))
    values[..., 0::2], values[..., 1::2] = FP4[blocks & 15], FP4[blocks >> 4]
    return values * np.repeat(2.0 ** (scales.astype(np.int64) - 127), 32, axis=-1)


def mxfp4_weights(rng):
    """Random bytes (every byte is two e2m1 values) and exponents near 2 ** -6."""
    w1 = rng.integers(0, 256, (E, 2 * INTER, H // 2), dtype=np.uint8)
    w2 = rng.integers(0, 256, (E, H, INTER // 2), dtype=np.uint8)
    s1 = rng.integers(117, 124, (E, 2 * INTER, H // 32), dtype=np.uint8)
    s2 = rng.integers(117, 124, (E, H, INTER // 32), dtype=np.uint8)
    return w1, w2, s1, s2


def routing(kind: str, tokens: int, top_k: int, rng) -> np.ndarray:
    if kind == "one_expert":
        return np.zeros((tokens, top_k), np.int32) + np.arange(top_k, dtype=np.int32)
    pool = [e for e in range(E) if kind != "empty_expert" or e != 2]
    return np.stack([rng.choice(pool, top_k, replace=False) for _ in range(tokens)]).astype(
        np.int32
    )


def test_decode_matches_transformers():
    """Every byte at exponents across the normal range, against Transformers' decoder."""
    torch = pytest.importorskip("torch")
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    blocks = np.arange(256, dtype=np.uint8).reshape(1, 16, 1, 16).repeat(2, axis=2)
    scales = np.array([2, 100, 127, 140, 200, 254], np.uint8)
    for s in scales:
        exps = np.full((1, 16, 2), s, np.uint8)
        theirs = mxfp4.convert_moe_packed_tensors(
            torch.from_numpy(blocks), torch.from_numpy(exps), dtype=torch.float32
        ).transpose(1, 2)  # Transformers returns GPT-OSS's [E, in, out]
        ours = quant.dequantize(blocks.reshape(1, 16, 32), exps, "mxfp4", jnp.float32)
        np.testing.assert_array_equal(np.asarray(ours), theirs.numpy())
        with np.errstate(over="ignore"):  # exponent 254 overflows f32 to inf, as theirs does
            expected = decode(blocks.reshape(1, 16, 32), exps).astype(np.float32)
        np.testing.assert_array_equal(np.asarray(ours), expected)


def lane_padded_scales(scales: np.ndarray, rng) -> np.ndarray:
    """Scales with trailing groups up to 128 (``padding``'s layout) holding random finite
    exponents (not 255: the kernel's 0/1 expansion multiplies them by 0): no byte belongs to
    them, so they must not change any result."""
    extra = rng.integers(0, 255, (*scales.shape[:2], 128 - scales.shape[2]), dtype=np.uint8)
    return np.concatenate([scales, extra], axis=2)


def _run(implementation, dtype, kind, tokens, top_k, *, gpt_oss: bool, padded_groups=False):
    rng = np.random.default_rng(tokens * 7 + top_k)
    x = rng.standard_normal((tokens, H)).astype(np.float32).astype(dtype)
    ids = routing(kind, tokens, top_k, rng)
    w = rng.random((tokens, top_k)).astype(np.float32)
    w1, w2, s1, s2 = mxfp4_weights(rng)
    b1 = rng.standard_normal((E, 2 * INTER)).astype(np.float32) if gpt_oss else None
    b2 = rng.standard_normal((E, H)).astype(np.float32) if gpt_oss else None
    layout = dict(activation="gpt_oss", interleaved=True) if gpt_oss else {}
    k1, k2 = (lane_padded_scales(s, rng) for s in (s1, s2)) if padded_groups else (s1, s2)
    got = api.fused_experts(
        x, ids, w, w1, w2, b1, b2, k1, k2, quantization="mxfp4", implementation=implementation,
        blocks=BLOCKS if implementation == "pallas" else None, **layout,
    )  # fmt: skip
    assert got.dtype == dtype and got.shape == (tokens, H)
    expected = oracle.experts(x, ids, w, decode(w1, s1), decode(w2, s2), b1, b2, **layout)
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    err = np.abs(got - expected).max() / max(np.abs(expected).max(), 1.0)
    assert err <= TOLERANCE[jnp.dtype(dtype).name], f"relative max error {err:.3g}"


@pytest.mark.parametrize(
    "dtype,kind,tokens,top_k",
    [(jnp.float32, "spread", 24, 2), (jnp.float32, "one_expert", 16, 1),
     (jnp.float32, "spread", 1, 2), (jnp.bfloat16, "empty_expert", 20, 3)],
)  # fmt: skip
def test_pallas_gpt_oss_layout_matches_oracle(dtype, kind, tokens, top_k):
    """GPT-OSS's form: interleaved gate/up, biases, the clamped activation; all tokens on one
    expert, an empty expert, a single token."""
    _run("pallas", dtype, kind, tokens, top_k, gpt_oss=True)


@pytest.mark.parametrize("implementation", ["pallas", "xla"])
def test_lane_padded_scale_groups_are_unread(implementation):
    """Scales whose group axis is padded to 128 (the layout ``padding`` stores, so the TPU keeps
    them row-major) with random trailing exponents: same results, two steps over I."""
    _run(implementation, jnp.float32, "spread", 24, 2, gpt_oss=True, padded_groups=True)


@pytest.mark.slow
@pytest.mark.parametrize("implementation", ["pallas", "xla"])
def test_stacked_silu_layout_matches_oracle(implementation):
    _run(implementation, jnp.bfloat16, "empty_expert", 20, 3, gpt_oss=False)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_xla_gpt_oss_layout_matches_oracle(dtype):
    _run("xla", dtype, "empty_expert", 20, 3, gpt_oss=True)


def test_bad_mxfp4_inputs_are_refused_with_the_rule():
    rng = np.random.default_rng(1)
    x = np.zeros((4, H), np.float32)
    ids, w = np.zeros((4, 1), np.int32), np.ones((4, 1), np.float32)
    w1, w2, s1, s2 = mxfp4_weights(rng)
    with pytest.raises(KernelInputError, match=r"gate_up_scale.*uint8"):
        api.fused_experts(x, ids, w, w1, w2, None, None, s1.astype(np.float32), s2,
                          quantization="mxfp4")  # fmt: skip
    odd = np.concatenate([s1, s1[:, :, :1]], axis=2)  # neither whole groups nor lane-padded
    with pytest.raises(KernelInputError, match=r"gate_up_scale of shape \(6, 1024, 8\)"):
        api.fused_experts(x, ids, w, w1, w2, None, None, odd, s2, quantization="mxfp4")
    with pytest.raises(KernelInputError, match=r"w_down .* must be \(6, 256, 256\)"):
        api.fused_experts(x, ids, w, w1, w1[:, :H], None, None, s1, s2, quantization="mxfp4")
    with pytest.raises(KernelInputError, match=r"w_gate_up.*uint8"):
        api.fused_experts(x, ids, w, w1.astype(np.int8), w2, None, None, s1, s2,
                          quantization="mxfp4")  # fmt: skip
    config = api.ExpertsConfig(quantization="mxfp4")
    assert "multiple of 256" in fused.blocks.ti_problem(128, INTER, config)
    assert fused.blocks.ti_problem(INTER, INTER, config) is None


def test_gpt_oss_size_runs_on_the_kernel_once_padded():
    """Unpadded H = I = 2880: the down block must span all of I and its decoded form exceeds
    VMEM, so the XLA path would run (said, not hidden). The Transformers integration pads H and I
    to 3072 once (``blocks.lane_padded``), where 512-wide intermediate blocks fit."""
    config = api.ExpertsConfig(quantization="mxfp4", interleaved=True)
    budget = int(0.85 * 128 * 2**20)
    blocks = fused.blocks.default_blocks(64, 4, 128, 2880, 2880, jnp.bfloat16, config, 1, budget)
    assert blocks is None
    padded = fused.blocks.lane_padded(2880, 2880, transposed=False, interleaved=True, packing=2)
    assert padded == (3072, 3072)
    blocks = fused.blocks.default_blocks(64, 4, 128, 3072, 3072, jnp.bfloat16, config, 1, budget)
    assert blocks is not None and blocks.ti == 512
