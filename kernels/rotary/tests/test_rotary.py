"""The rotary kernel: values against a float64 oracle and bit for bit against torch's eager
formula (f32, bf16, mixed), gradients, every form (rotate-half, interleaved pairs, partial rotary,
both layouts, upcast / cast back), Pallas interpret mode at TPU block sizes with several blocks,
the torch op's contract (opcheck, fullgraph compile) and error messages."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from kernel_hub import get_kernel
from kernel_hub.errors import KernelInputError, NoImplementationError

k = get_kernel("rotary", local_dir=Path(__file__).resolve().parents[1])
IMPLEMENTATIONS = ["xla", "pallas"]
VARIANTS = {
    "half": {"unsqueeze_dim": 1, "interleaved": False, "rot": 32},
    "interleaved": {"unsqueeze_dim": 1, "interleaved": True, "rot": 32},
    "partial-half-bshd": {"unsqueeze_dim": 2, "interleaved": False, "rot": 16},
    "partial-interleaved": {"unsqueeze_dim": 1, "interleaved": True, "rot": 8},
}
FORMS = {"promote": (False, False), "cast-back": (False, True), "upcast": (True, True)}


def _rotate(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if interleaved:
        return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def torch_formula(x, cos, sin, unsqueeze_dim, interleaved, upcast=False, cast_back=False):
    """What the Transformers functions compute, in torch's eager arithmetic (the oracle in f64)."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    rot = cos.shape[-1]
    part = x[..., :rot].float() if upcast else x[..., :rot]
    y = part * cos + _rotate(part, interleaved) * sin
    y = y.to(x.dtype) if cast_back else y
    return torch.cat((y, x[..., rot:].to(y.dtype)), dim=-1)


def assert_eager_bits(out, want, x, cos, sin, unsqueeze_dim, interleaved, f32_arithmetic=None):
    """Same dtype; bit for bit when the arithmetic is 16-bit (every rounding is explicit); with
    f32 arithmetic within one f32 rounding of the products (XLA fuses a product and the sum into
    an FMA), plus one rounding of the result's dtype where that is narrower (cast back)."""
    assert out.dtype == want.dtype
    if f32_arithmetic is None:
        f32_arithmetic = want.dtype == torch.float32
    if not f32_arithmetic:
        assert torch.equal(out, want)
        return
    c, sn = cos.double().unsqueeze(unsqueeze_dim), sin.double().unsqueeze(unsqueeze_dim)
    part = x.double()[..., : c.shape[-1]]
    magnitude = part.abs() * c.abs() + _rotate(part, interleaved).abs() * sn.abs()
    magnitude = torch.cat((magnitude, x.double()[..., c.shape[-1] :].abs()), dim=-1)
    bound = torch.finfo(torch.float32).eps * magnitude
    if want.dtype != torch.float32:
        bound = bound + torch.finfo(want.dtype).eps * want.double().abs()
    assert bool(((out.double() - want.double()).abs() <= bound).all())


def inputs(variant: str, dtype=torch.float32, table_dtype=None, seq=12, table_batch=2):
    options = VARIANTS[variant]
    generator = torch.Generator().manual_seed(0)

    def randn(*shape, dt=dtype):
        return torch.randn(*shape, generator=generator).to(dt)

    def tensor(heads):
        shape = (2, heads, seq, 32) if options["unsqueeze_dim"] == 1 else (2, seq, heads, 32)
        return randn(*shape)

    table = table_dtype or dtype
    cos = randn(table_batch, seq, options["rot"], dt=table)
    sin = randn(table_batch, seq, options["rot"], dt=table)
    return tensor(4), tensor(2), cos, sin, options["unsqueeze_dim"], options["interleaved"]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_forward_is_torch_eager_and_close_to_float64(variant, dtype, implementation):
    q, kk, cos, sin, dim, interleaved = inputs(variant, dtype)
    got = k.rotary_embedding(q, kk, cos, sin, dim, interleaved, implementation=implementation)
    for x, out in zip((q, kk), got, strict=True):
        want = torch_formula(x, cos, sin, dim, interleaved)
        assert_eager_bits(out, want, x, cos, sin, dim, interleaved)
        exact = torch_formula(x.double(), cos.double(), sin.double(), dim, interleaved)
        tol = 1e-6 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out.double(), exact, rtol=tol, atol=tol * 4)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("form", list(FORMS))
def test_rounding_forms_match_their_torch_formulas_with_mixed_dtypes(form, implementation):
    """bf16 q and k with f32 cos and sin (autocast) and all-bf16: each form's dtype and bits
    (all-bf16 without upcast is bit for bit)."""
    upcast, cast_back = FORMS[form]
    for table_dtype in (torch.float32, torch.bfloat16):
        q, kk, cos, sin, dim, inter = inputs("half", torch.bfloat16, table_dtype, table_batch=1)
        got = k.rotary_embedding(
            q, kk, cos, sin, dim, inter, upcast, cast_back, implementation=implementation
        )
        f32 = upcast or table_dtype == torch.float32
        for x, out in zip((q, kk), got, strict=True):
            want = torch_formula(x, cos, sin, dim, inter, upcast, cast_back)
            assert_eager_bits(out, want, x, cos, sin, dim, inter, f32_arithmetic=f32)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", ["half", "partial-interleaved", "partial-half-bshd"])
def test_q_and_k_gradients_match_float64(variant, dtype, implementation):
    q, kk, cos, sin, dim, interleaved = inputs(variant, dtype)
    q.requires_grad_(), kk.requires_grad_()
    gq, gk = torch.randn_like(q), torch.randn_like(kk)
    out_q, out_k = k.rotary_embedding(
        q, kk, cos, sin, dim, interleaved, implementation=implementation
    )
    torch.autograd.backward((out_q, out_k), (gq, gk))
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    for x, g in ((q, gq), (kk, gk)):
        x64 = x.detach().double().requires_grad_()
        torch_formula(x64, cos.double(), sin.double(), dim, interleaved).backward(g.double())
        assert x.grad.dtype == dtype
        torch.testing.assert_close(x.grad.double(), x64.grad, rtol=tol, atol=tol * 4)


def test_jax_cos_and_sin_gradients_match_autodiff_of_the_reference():
    q, kk, cos, sin, dim, interleaved = (
        jnp.asarray(t.numpy()) if isinstance(t, torch.Tensor) else t
        for t in inputs("partial-interleaved", table_batch=1)
    )

    def loss(implementation):
        def total(*arrays):
            a, b = k.jax.rotary_embedding(
                *arrays, unsqueeze_dim=dim, interleaved=interleaved, implementation=implementation
            )
            return jnp.sum(jnp.sin(a)) + jnp.sum(b * b)

        return jax.jit(jax.grad(total, argnums=(0, 1, 2, 3)))(q, kk, cos, sin)

    for got, want in zip(loss("pallas"), loss("xla"), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("dtype", "unsqueeze_dim"), [(jnp.float32, 1), (jnp.bfloat16, 2)])
def test_pallas_tpu_blocks_several_per_grid_axis_with_a_ragged_last_one(dtype, unsqueeze_dim):
    """128-position blocks (a multiple of every sublane tile), head dim 128 (one lane tile),
    grid (2 batches, 3 sequence blocks), the last block partly past the end; grouped k."""
    seq, dim = 2 * 128 + 40, 128

    def tensor(key, heads):
        shape = (2, heads, seq, dim) if unsqueeze_dim == 1 else (2, seq, heads, dim)
        return jax.random.normal(jax.random.key(key), shape, dtype)

    q, kk = tensor(0, 2), tensor(1, 1)
    cos = jax.random.normal(jax.random.key(2), (2, seq, dim), dtype)
    sin = jax.random.normal(jax.random.key(3), (2, seq, dim), dtype)

    def run(implementation, **options):
        def total(a, b):
            out_q, out_k = k.jax.rotary_embedding(
                a,
                b,
                cos,
                sin,
                unsqueeze_dim=unsqueeze_dim,
                implementation=implementation,
                **options,
            )
            return jnp.sum(out_q.astype(jnp.float32) ** 2) + jnp.sum(out_k.astype(jnp.float32))

        outs = k.jax.rotary_embedding(
            q, kk, cos, sin, unsqueeze_dim=unsqueeze_dim, implementation=implementation, **options
        )
        return outs, jax.jit(jax.grad(total, argnums=(0, 1)))(q, kk)

    got, want = run("pallas", block_seq=128), run("xla")
    tol = 1e-6 if dtype == jnp.float32 else 1e-2
    for g, w in zip(jax.tree.leaves(got[0]), jax.tree.leaves(want[0]), strict=True):
        if dtype == jnp.bfloat16:  # 16-bit roundings are explicit: the same bits
            np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=tol, atol=tol)
    for g, w in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]), strict=True):
        w = np.asarray(w, np.float32)
        np.testing.assert_allclose(np.asarray(g, np.float32), w, rtol=tol, atol=tol * abs(w).max())


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_opcheck(implementation):
    q, kk, cos, sin, dim, interleaved = inputs("partial-half-bshd")
    torch.library.opcheck(
        k.rotary_embedding.op, (q, kk, cos, sin, dim, interleaved, False, False, implementation)
    )


def test_fullgraph_compile_matches_eager_with_gradients():
    q, kk, cos, sin, dim, interleaved = inputs("interleaved")
    q.requires_grad_()

    def step(q, kk, cos, sin):
        a, b = k.rotary_embedding(q, kk, cos, sin, dim, interleaved)
        return (a * a).sum() + b.sum()

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    loss = compiled(q, kk, cos, sin)
    (grad,) = torch.autograd.grad(loss, q)
    want = step(q, kk, cos, sin)
    (want_grad,) = torch.autograd.grad(want, q)
    assert torch.equal(loss, want) and torch.equal(grad, want_grad)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"unsqueeze_dim": 3}, r"unsqueeze_dim=3; valid: 1 .* or 2"),
        ({"cos": torch.randn(2, 12, 7)}, r"rotary dim must be even"),
        ({"cos": torch.randn(2, 12, 64)}, r"rotary dim must be even and between 2 and the head"),
        ({"cos": torch.randn(3, 12, 32)}, r"must be \[1 or 2, 12, rotary dim\]"),
        ({"k": torch.randn(2, 2, 11, 32)}, r"must agree on batch, sequence and head dim"),
        ({"q": torch.randn(2, 4, 12)}, r"q"),
    ],
)
def test_bad_inputs_are_refused_with_what_is_valid(change, message):
    q, kk, cos, sin, dim, _ = inputs("half")
    args = {"q": q, "k": kk, "cos": cos, "sin": sin, "unsqueeze_dim": dim}
    args.update(change)
    if "cos" in change:
        args["sin"] = change["cos"]
    with pytest.raises(KernelInputError, match=message):
        k.rotary_embedding(**args)


def test_cos_that_needs_a_gradient_is_refused_not_dropped():
    q, kk, cos, sin, dim, _ = inputs("half")
    with pytest.raises(KernelInputError, match="gradients for q and k only"):
        k.rotary_embedding(q, kk, cos.requires_grad_(), sin, dim)


def test_illegal_block_is_refused_with_the_rule():
    q = jnp.ones((1, 2, 40, 128))
    cos = jnp.ones((1, 40, 128))
    with pytest.raises(NoImplementationError, match=r"block_seq=12 must equal sequence"):
        k.jax.rotary_embedding(q, q, cos, cos, implementation="pallas", block_seq=12)
