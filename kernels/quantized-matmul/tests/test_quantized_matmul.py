"""quantized_matmul's values against a float64 oracle of the dequantized weight (fp8 128x128
blocks, int8 per channel, GPTQ-packed int4 in groups of 128, symmetric and with per-group zero
points; f32, bf16), Pallas interpret mode
at TPU block sizes with several blocks and ragged tails, the activations' gradient, the torch
op's contract, and errors."""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from kernel_hub import get_kernel
from kernel_hub.errors import KernelInputError, NoImplementationError

k = get_kernel("quantized-matmul", local_dir=Path(__file__).resolve().parents[1])
IMPLEMENTATIONS = ["xla", "pallas"]
# relative to the output's largest magnitude: f32 accumulation; bf16 activations and weights
TOL = {torch.float32: 2e-6, torch.bfloat16: 1e-2}


def pack_int4(nibbles: torch.Tensor) -> torch.Tensor:
    """GPTQ's packing of [in, out] values 0..15, written out: word r of column o holds input
    rows 8r..8r+7, row 8r + j in bits 4j..4j+3."""
    inner, out = nibbles.shape
    words = torch.zeros(inner // 8, out, dtype=torch.int64)
    for j in range(8):
        words |= nibbles[j::8].long() << (4 * j)
    return (words - (words >= 2**31).long() * 2**32).to(torch.int32)  # the same 32 bits


def quantized(fmt: str, out: int, inner: int, seed: int = 0):
    """A random weight in ``fmt`` with scales that differ per channel / block / group, as torch
    tensors (int4: packed [in / 8, out] and scale [in / 128, out])."""
    gen = torch.Generator().manual_seed(seed)
    if fmt == "int4":
        nibbles = torch.randint(0, 16, (inner, out), generator=gen)
        return pack_int4(nibbles), torch.rand(inner // 128, out, generator=gen) / 8 + 1 / 16
    w = torch.randn(out, inner, generator=gen)
    if fmt == "int8":
        weight = (w * 40).round().clamp(-127, 127).to(torch.int8)
        scale = torch.rand(out, generator=gen) / 40 + 0.5 / 40
    else:
        weight = w.to(torch.float8_e4m3fn)
        scale = torch.rand(-(-out // 128), -(-inner // 128), generator=gen) + 0.5
    return weight, scale


def zero_points(scale: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """Random int4 zero points 0..15, one per entry of an int4 weight's group scale."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 16, scale.shape, generator=gen, dtype=torch.int32)


def dequantized64(weight: torch.Tensor, scale: torch.Tensor, zeros=None) -> torch.Tensor:
    """float64 ``weight * scale`` [out, in] (the format's meaning), independent of the kernel's
    code."""
    if weight.dtype == torch.int32:  # int4: unpack nibble j of every word, zero point 8 or zeros
        words = weight.long() & 0xFFFFFFFF
        nibbles = torch.stack([(words >> (4 * j)) & 0xF for j in range(8)], dim=1)
        zero = 8 if zeros is None else zeros.double().repeat_interleave(128, 0)
        values = nibbles.reshape(-1, weight.shape[1]).double() - zero
        return (values * scale.double().repeat_interleave(128, 0)).T
    out, inner = weight.shape
    if weight.dtype == torch.int8:
        return weight.double() * scale.double()[:, None]
    full = scale.double().repeat_interleave(128, 0).repeat_interleave(128, 1)
    return weight.double() * full[:out, :inner]


def oracle(x, weight, scale, dtype, zeros=None):
    """x @ W^T in float64, with W rounded to the activation dtype as a dequantized layer's is."""
    w = dequantized64(weight, scale, zeros).to(dtype).double()
    return x.double() @ w.T


def assert_close(got: torch.Tensor, want: torch.Tensor, tol: float):
    err = float((got.double() - want).abs().max() / want.abs().max())
    assert err <= tol, f"max error {err:.2e} (relative to max |out|) > {tol}"


def matmul(x, weight, scale, *args):
    """The torch op for the weight's format."""
    op = k.quantized_matmul_int4 if weight.dtype == torch.int32 else k.quantized_matmul
    return op(x, weight, scale, *args)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["fp8", "int8", "int4"])
def test_forward_matches_float64_oracle(fmt, dtype, implementation):
    inner = 256 if fmt == "int4" else 300  # ragged 128-blocks both ways; int4: whole groups
    weight, scale = quantized(fmt, 200, inner)
    x = torch.randn(2, 3, inner).to(dtype)
    out = matmul(x, weight, scale, None, implementation)
    assert out.dtype == dtype and out.shape == (2, 3, 200)
    assert_close(out, oracle(x, weight, scale, dtype), TOL[dtype])


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_zero_points_match_float64_oracle(dtype, implementation):
    """Asymmetric int4 (GPTQ sym=False, AWQ): each group and output column subtracts its own
    zero point."""
    weight, scale = quantized("int4", 200, 256)
    zeros = zero_points(scale)
    x = torch.randn(2, 3, 256).to(dtype)
    out = k.quantized_matmul_int4(x, weight, scale, None, implementation, zeros)
    assert out.dtype == dtype and out.shape == (2, 3, 200)
    assert_close(out, oracle(x, weight, scale, dtype, zeros), TOL[dtype])
    symmetric = oracle(x, weight, scale, dtype)  # the zeros are read: not the constant 8
    assert float((out.double() - symmetric).abs().max() / symmetric.abs().max()) > 0.1


@pytest.mark.parametrize(
    ("fmt", "dtype"),
    [("fp8", jnp.bfloat16), ("int8", jnp.float32), ("int4z", jnp.bfloat16)],
)
def test_pallas_several_blocks_with_ragged_tails(fmt, dtype):
    """TPU block sizes (tm one bf16 sublane tile, tn and tk 256; int4: tk 1024, its smallest
    split): 2 x 2 x 2 blocks, each axis's last one partly past the end (m 20, out 320 = 2.5 fp8
    blocks, in 384; int4 in 1536, with zero points: the symmetric form differs only by its
    constant zero), forward and gradient."""
    int4 = fmt.startswith("int4")
    inner, tk = (1536, 1024) if int4 else (384, 256)
    weight, scale = quantized("int4" if int4 else fmt, 320, inner, seed=1)
    zeros = jnp.asarray(zero_points(scale, seed=1).numpy()) if fmt == "int4z" else None
    stored = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}.get(fmt, jnp.int32)
    weight = jnp.asarray(weight.numpy() if int4 else weight.float().numpy()).astype(stored)
    scale = jnp.asarray(scale.numpy())
    x = jax.random.normal(jax.random.key(0), (20, inner), dtype)
    blocks = k.jax.BlockSizes(tm=16, tn=256, tk=tk)
    if int4:
        fn = functools.partial(k.jax.quantized_matmul_int4, zeros=zeros)
    else:
        fn = k.jax.quantized_matmul

    def loss(implementation, **options):
        def total(a):
            out = fn(a, weight, scale, implementation=implementation, **options)
            return jnp.sum(out.astype(jnp.float32) ** 2)

        return total

    # one jitted program each: run eagerly, each primitive of the backward compiles alone
    got = jax.jit(jax.value_and_grad(loss("pallas", block_sizes=blocks)))(x)
    want = jax.jit(jax.value_and_grad(loss("xla")))(x)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    for g, w in zip(got, want, strict=True):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert np.abs(g - w).max() <= tol * np.abs(w).max()
    out = fn(x, weight, scale, implementation="pallas", block_sizes=blocks)
    assert bool(jnp.all(jnp.isfinite(out)))


@pytest.mark.parametrize("fmt", ["fp8", "int8", "int4", "int4z"])
def test_activation_gradient_matches_float64_oracle(fmt):
    inner = 256 if fmt.startswith("int4") else 260
    weight, scale = quantized(fmt.removesuffix("z"), 130, inner)
    zeros = zero_points(scale) if fmt == "int4z" else None
    x = torch.randn(5, inner, requires_grad=True)
    grad = torch.randn(5, 130)
    extra = (zeros,) if zeros is not None else ()
    matmul(x, weight, scale, None, "pallas", *extra).backward(grad)
    want = grad.double() @ dequantized64(weight, scale, zeros).float().double()
    assert_close(x.grad, want, 2e-6)


@pytest.mark.parametrize("fmt", ["int8", "int4", "int4z"])
def test_opcheck(fmt):
    """int8 and int4 (int4z: with zero points): torch's checks multiply every tensor argument,
    which torch cannot for fp8 (the fp8 op shares every code path but the weight's dtype)."""
    weight, scale = quantized(fmt.removesuffix("z"), 128, 256)
    op = k.quantized_matmul_int4 if fmt.startswith("int4") else k.quantized_matmul
    extra = (zero_points(scale),) if fmt == "int4z" else ()
    torch.library.opcheck(op.op, (torch.randn(4, 256), weight, scale, None, "xla", *extra))


def test_compile_fullgraph_fp8():
    weight, scale = quantized("fp8", 128, 256)
    x = torch.randn(4, 256)
    compiled = torch.compile(lambda a: k.quantized_matmul(a, weight, scale) * 2, fullgraph=True)
    torch.testing.assert_close(compiled(x), k.quantized_matmul(x, weight, scale) * 2)


def test_wrong_scale_shape_is_refused_with_the_valid_shape():
    weight, _ = quantized("fp8", 200, 300)
    with pytest.raises(KernelInputError, match=r"needs scale of shape \(2, 3\).*128x128"):
        k.quantized_matmul(torch.randn(4, 300), weight, torch.ones(200))


def test_unquantized_weight_is_refused():
    with pytest.raises(KernelInputError, match="weight"):
        k.quantized_matmul(torch.randn(4, 64), torch.randn(8, 64), torch.ones(8))


def test_a_weight_that_requires_grad_is_refused():
    weight, scale = quantized("int8", 8, 64)
    scale.requires_grad_()
    with pytest.raises(KernelInputError, match="scale"):
        k.quantized_matmul(torch.randn(4, 64, requires_grad=True), weight, scale)


def test_illegal_block_is_refused_with_the_rule():
    weight, scale = quantized("int8", 256, 256)
    x, w, s = jnp.ones((8, 256)), jnp.asarray(weight.numpy()), jnp.asarray(scale.numpy())
    with pytest.raises(NoImplementationError, match=r"tn=100 must equal .* multiple of 128"):
        k.jax.quantized_matmul(
            x, w, s, implementation="pallas", block_sizes=k.jax.BlockSizes(8, 100, 256)
        )


def test_int4_needs_whole_groups_and_its_own_op():
    weight, scale = quantized("int4", 128, 256)
    with pytest.raises(KernelInputError, match=r"whole groups of 128"):
        k.quantized_matmul_int4(torch.randn(4, 192), weight[:24], scale[:1])
    with pytest.raises(KernelInputError, match=r"weight.*int8.*float8_e4m3fn"):
        k.quantized_matmul(torch.randn(4, 256), weight, scale)
    with pytest.raises(KernelInputError, match=r"needs scale of shape \(2, 128\).*group of 128"):
        k.quantized_matmul_int4(torch.randn(4, 256), weight, scale.T.contiguous())
    with pytest.raises(KernelInputError, match=r"zeros \(1, 128\) must have the scale's shape"):
        k.quantized_matmul_int4(
            torch.randn(4, 256), weight, scale, None, None, zero_points(scale)[:1]
        )
    with pytest.raises(KernelInputError, match=r"zeros.*int32"):
        k.quantized_matmul_int4(torch.randn(4, 256), weight, scale, None, None, scale)


def test_int4_tk_must_hold_whole_scale_tiles():
    weight, scale = quantized("int4", 128, 2048)
    x, w, s = jnp.ones((8, 2048)), jnp.asarray(weight.numpy()), jnp.asarray(scale.numpy())
    with pytest.raises(NoImplementationError, match=r"tk=512 must equal .* multiple of 1024"):
        k.jax.quantized_matmul_int4(
            x, w, s, implementation="pallas", block_sizes=k.jax.BlockSizes(8, 128, 512)
        )


def fake_quantized_rows(x: torch.Tensor) -> torch.Tensor:
    """float64 rows of x quantized per token to int8 (max |row| at 127, half to even) and back:
    what W8A8's activations stand for, written out here."""
    amax = x.double().abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax.float() / 127, 1.0).double()
    return (x.double() / scale).round().clamp(-127, 127) * scale


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_w8a8_is_exact_against_quantized_activations_and_weights(implementation):
    """At TPU blocks (tm 32, an int8 sublane tile; tn and tk 256): 2 x 2 x 2 blocks with ragged
    tails (m 40, out 320, in 384), an all-zero row; the twin is the dequantized weight times
    the per-token quantized activations. Its error against W8A16 is measured, not zero."""
    weight, scale = quantized("int8", 320, 384, seed=4)
    x = torch.randn(40, 384)
    x[3] = 0
    blocks = {"block_sizes": k.jax.BlockSizes(32, 256, 256)} if implementation == "pallas" else {}
    got = k.jax.quantized_matmul(
        jnp.asarray(x.numpy()),
        jnp.asarray(weight.numpy()),
        jnp.asarray(scale.numpy()),
        implementation=implementation,
        activations="int8",
        **blocks,
    )
    got = torch.from_numpy(np.asarray(got)).double()
    want = fake_quantized_rows(x) @ dequantized64(weight, scale).T
    assert_close(got, want, 2e-6)
    assert bool((got[3] == 0).all())
    w8a16 = oracle(x, weight, scale, torch.float32)
    error = float((got - w8a16).abs().max() / w8a16.abs().max())
    assert 1e-4 < error < 3e-2, error  # lossy (int8 activations), not broken


def test_w8a8_is_refused_for_other_weights_and_for_gradients():
    weight, scale = quantized("fp8", 128, 256)
    with pytest.raises(KernelInputError, match=r"activations='int8' with a fp8 weight; valid"):
        k.quantized_matmul(torch.randn(4, 256), weight, scale, None, None, "int8")
    weight, scale = quantized("int8", 128, 256)
    x = torch.randn(4, 256, requires_grad=True)
    with pytest.raises(KernelInputError, match=r"\(W8A8\) has no gradient"):
        k.quantized_matmul(x, weight, scale, None, "xla", "int8").sum().backward()
