"""gmm_quantized (int8 per-channel and fp8 128x128-block expert weights) against a float64
oracle of the same dequantization: values, the activations' gradient (JAX and the torch op),
Pallas interpret mode at TPU block sizes with several blocks on every grid axis, ragged groups
with empty ones, and its input errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import moe_gemm_oracle as oracle
import numpy as np
import pytest
import torch

from kernel_hub import get_kernel
from kernel_hub.errors import KernelInputError, NoImplementationError

moe = get_kernel("moe-gemm")
Tiling = moe.jax.Tiling

E, OUT, IN, ROWS = 4, 256, 384, 200
SIZES = [0, 90, 0, 80]  # empty first and middle groups, a boundary inside a row tile, 30 spare
ONE_EXPERT = [0, 0, 0, ROWS]
TPU_TILING = Tiling(128, 128, 128)  # 2 row tiles, 2-3 blocks on the contraction and the output
PALLAS_CASES = [  # every format x direction in f32, each format's forward in bf16
    (fmt, transpose_rhs, jnp.float32) for fmt in ("int8", "fp8") for transpose_rhs in (True, False)
] + [("int8", True, jnp.bfloat16), ("fp8", True, jnp.bfloat16)]
XLA_CASES = [
    (fmt, transpose_rhs, dtype)
    for fmt in ("int8", "fp8")
    for transpose_rhs in (True, False)
    for dtype in (jnp.float32, jnp.bfloat16)
]


def _quantized(fmt: str, seed: int = 0):
    """(weight, scale) of a random [E, OUT, IN] weight, quantized to nearest in ``fmt``."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((E, OUT, IN)).astype(np.float32) / np.sqrt(IN)
    if fmt == "int8":
        scale = np.abs(w).max(axis=2) / 127
        q = np.clip(np.round(w / scale[:, :, None]), -127, 127).astype(np.int8)
        return jnp.asarray(q), jnp.asarray(scale, jnp.float32)
    tiles = w.reshape(E, OUT // 128, 128, IN // 128, 128)
    scale = (np.abs(tiles).max(axis=(2, 4)) / 448).astype(np.float32)
    full = np.repeat(np.repeat(scale, 128, axis=1), 128, axis=2)
    return jnp.asarray(w / full).astype(jnp.float8_e4m3fn), jnp.asarray(scale)


def _lhs(transpose_rhs: bool, dtype, seed: int = 1):
    k = IN if transpose_rhs else OUT
    return jnp.asarray(np.random.default_rng(seed).standard_normal((ROWS, k)), dtype)


def _expected(lhs, weight, scale, fmt, sizes, transpose_rhs):
    w = oracle.dequantize(weight, scale, fmt)  # [E, out, in]
    return oracle.gmm(lhs, w, sizes, transpose_rhs=transpose_rhs)


@pytest.mark.parametrize(
    ("implementation", "fmt", "transpose_rhs", "dtype"),
    [("pallas", *c) for c in PALLAS_CASES] + [("xla", *c) for c in XLA_CASES],
)
def test_values_match_float64_dequantization(implementation, fmt, transpose_rhs, dtype):
    weight, scale = _quantized(fmt)
    lhs = _lhs(transpose_rhs, dtype)
    tiling = TPU_TILING if implementation == "pallas" else None
    got = moe.jax.gmm_quantized(lhs, weight, scale, jnp.asarray(SIZES, jnp.int32),
                                transpose_rhs=transpose_rhs, implementation=implementation,
                                tiling=tiling)  # fmt: skip
    assert got.dtype == dtype
    expected = _expected(lhs, weight, scale, fmt, SIZES, transpose_rhs)
    oracle.assert_close(got, expected, jnp.dtype(dtype).name, f"{fmt} {implementation}")
    assert not np.asarray(got[sum(SIZES) :], np.float32).any()  # rows past the groups: zeros


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_all_rows_on_one_expert_with_default_tiling(fmt):
    weight, scale = _quantized(fmt)
    lhs = _lhs(True, jnp.float32)
    sizes = jnp.asarray(ONE_EXPERT, jnp.int32)
    got = moe.jax.gmm_quantized(lhs, weight, scale, sizes, implementation="pallas")
    expected = _expected(lhs, weight, scale, fmt, ONE_EXPERT, True)
    oracle.assert_close(got, expected, "float32", fmt)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_activation_gradient_matches_oracle_and_weights_are_frozen(fmt):
    """The VJP wiring (the backward kernel itself is the values test's ``transpose_rhs=False``,
    Pallas included)."""
    weight, scale = _quantized(fmt)
    lhs, cot = _lhs(True, jnp.float32), _lhs(False, jnp.float32, seed=2)
    sizes = jnp.asarray(SIZES, jnp.int32)
    implementation = "xla"

    def f(x, s):
        return moe.jax.gmm_quantized(x, weight, s, sizes, implementation=implementation)

    _, pullback = jax.vjp(jax.jit(f), lhs, scale)
    dlhs, dscale = pullback(cot)
    w = oracle.dequantize(weight, scale, fmt)
    oracle.assert_close(dlhs, oracle.gmm(cot, w, SIZES), "float32", f"dlhs {fmt}")
    assert not np.asarray(dscale).any()  # frozen: no gradient reaches the scales
    direct = moe.jax.gmm_quantized_vjp(lhs, weight, scale, sizes, cot,
                                       implementation=implementation)  # fmt: skip
    oracle.assert_close(direct, oracle.gmm(cot, w, SIZES), "float32", f"gmm_quantized_vjp {fmt}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_op_values_and_activation_gradient(dtype):
    weight, scale = _quantized("fp8")
    w_t = torch.from_numpy(np.array(weight.view(jnp.uint8))).view(torch.float8_e4m3fn)
    s_t = torch.from_numpy(np.array(scale))
    x = torch.from_numpy(np.array(_lhs(True, jnp.float32))).to(dtype).requires_grad_()
    sizes = torch.tensor(SIZES, dtype=torch.int32)
    out = moe.gmm_quantized(x, w_t, s_t, sizes)
    assert out.dtype == dtype and out.shape == (ROWS, OUT)
    cot = torch.randn(ROWS, OUT, generator=torch.Generator().manual_seed(3)).to(dtype)
    out.backward(cot)
    w = oracle.dequantize(weight, scale, "fp8")
    name = str(dtype).removeprefix("torch.")
    oracle.assert_close(out.detach().float(), _expected(x.detach().float(), weight, scale, "fp8",
                                                        SIZES, True), name, "out")  # fmt: skip
    oracle.assert_close(x.grad.float(), oracle.gmm(cot.float(), w, SIZES), name, "d lhs")


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_torch_op_passes_opcheck(fmt):
    weight, scale = _quantized(fmt)
    dtype = torch.int8 if fmt == "int8" else torch.float8_e4m3fn
    w_t = torch.from_numpy(np.array(weight.view(jnp.int8))).view(dtype)[:, :, :128]
    s_t = torch.from_numpy(np.array(scale))
    s_t = s_t if fmt == "int8" else s_t[:, :, :1].contiguous()
    x = torch.randn(9, 128, requires_grad=True)
    sizes = torch.tensor([3, 0, 4, 1], dtype=torch.int32)
    # torch's schema check multiplies every tensor argument, which torch has no fp8 kernel for
    utils = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    test_utils = utils if fmt == "fp8" else (*utils, "test_schema")
    torch.library.opcheck(moe.gmm_quantized.op, (x, w_t, s_t, sizes), test_utils=test_utils)


def test_input_errors_name_what_is_wrong():
    weight, scale = _quantized("int8")
    lhs, sizes = _lhs(True, jnp.float32), jnp.asarray(SIZES, jnp.int32)
    gmm_q = moe.jax.gmm_quantized
    with pytest.raises(KernelInputError, match=r"needs scale of shape \(4, 256\)"):
        gmm_q(lhs, weight, scale[:, :128], sizes)
    with pytest.raises(
        KernelInputError, match="weight has dtype float32; supported: int8, float8_e4m3fn"
    ):
        gmm_q(lhs, weight.astype(jnp.float32), scale, sizes)
    with pytest.raises(KernelInputError, match=r"has k=384 .* contracting out"):
        gmm_q(lhs, weight, scale, sizes, transpose_rhs=False)
    with pytest.raises(KernelInputError, match="one size per expert"):
        gmm_q(lhs, weight, scale, sizes[:3])
    fp8, fp8_scale = _quantized("fp8")
    with pytest.raises(KernelInputError, match="whole 128x128 blocks"):
        gmm_q(lhs[:, :320], fp8[:, :, :320], fp8_scale[:, :, :3], sizes)
    with pytest.raises(NoImplementationError, match="tk and tn multiples of 128"):
        gmm_q(lhs, fp8, fp8_scale, sizes, implementation="pallas", tiling=Tiling(128, 384, 64))


def _small_fp8():
    """fp8 weight [4, 256, 128] (2 x 1 blocks per expert), its scale, lhs [9, 128], sizes."""
    weight, scale = _quantized("fp8")
    w_t = torch.from_numpy(np.array(weight.view(jnp.int8))).view(torch.float8_e4m3fn)
    s_t = torch.from_numpy(np.array(scale))
    x = torch.randn(9, 128, generator=torch.Generator().manual_seed(4))
    return w_t[:, :, :128].contiguous(), s_t[:, :, :1].contiguous(), x, torch.tensor([3, 0, 4, 1])


def test_torch_op_refuses_a_weight_or_scale_that_requires_grad():
    """Quantized weights are frozen: a weight or scale asking for a gradient is refused before
    any kernel runs, also after a first call of the same signature without one (which the
    eager fast path validated and cached); without grad mode it runs."""
    w_t, s_t, x, sizes = _small_fp8()
    expected = moe.gmm_quantized(x, w_t, s_t, sizes)
    for name in ("weight", "scale"):
        w, s = w_t.clone(), s_t.clone()
        (w if name == "weight" else s).requires_grad_()
        for lhs in (x, x.clone().requires_grad_()):
            with pytest.raises(KernelInputError, match=rf"gmm_quantized: {name} requires grad"):
                moe.gmm_quantized(lhs, w, s, sizes)
        with torch.no_grad():
            torch.testing.assert_close(moe.gmm_quantized(x, w, s, sizes), expected)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("transpose_rhs", [True, False])
def test_sharding_rule_follows_the_weight_into_its_scale(fmt, transpose_rhs):
    """The rule the torch op's DTensor strategies and the JAX boundary share: the scale's rank
    (2: int8 per channel, 3: fp8 blocks) picks its layout; the scale splits with its weight."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    from kernel_hub.sharding.boundary import choose_rule, rule_of
    from kernel_hub.sharding.dtensor import forward_strategies

    ranks = (2, 3, 2 if fmt == "int8" else 3, 1)
    rule = choose_rule(rule_of(moe.jax.gmm_quantized), {"transpose_rhs": transpose_rhs}, ranks)
    n, k = (1, 2) if transpose_rhs else (2, 1)  # the weight's dims [E, out, in] by role
    # fp8's block scale [E, out/128, in/128] splits as its weight; int8's [E, out] holds the out
    # dim only: n with transpose_rhs, else k
    fp8 = fmt == "fp8"
    scale_n = Shard(n) if fp8 else Shard(1) if transpose_rhs else Replicate()
    scale_k = Shard(k) if fp8 else Replicate() if transpose_rhs else Shard(1)
    strategies = forward_strategies(rule, list(ranks))
    assert ([Shard(1)], [Replicate(), Shard(n), scale_n, Replicate()]) in strategies
    assert ([Partial()], [Shard(1), Shard(k), scale_k, Replicate()]) in strategies
