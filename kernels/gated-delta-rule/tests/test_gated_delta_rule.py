"""gated-delta-rule: values and gradients against a float64 torch oracle across chunk boundaries,
packed sequences and initial states (both implementations, f32 and bf16), exactness against
Transformers' own torch fallbacks, the torch op contract and input errors."""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from kernel_hub import get_kernel
from kernel_hub.errors import KernelInputError, NoImplementationError
from kernel_hub.testing import max_errors

gdr = get_kernel("gated-delta-rule")
CHUNK = 32  # the kernel's chunk in these tests: lengths below cross it
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
IMPLEMENTATIONS = ["xla", "pallas"]


def oracle(q, k, v, g, beta, state=None, cu_seqlens=None, l2norm=True):
    """Token-by-token gated delta rule in float64 (independent of the kernel's JAX code)."""
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    if l2norm:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * q.shape[-1] ** -0.5
    groups = v.shape[2] // q.shape[2]
    q, k = q.repeat_interleave(groups, 2), k.repeat_interleave(groups, 2)
    bounds = (
        [(b, 0, q.shape[1]) for b in range(q.shape[0])]
        if cu_seqlens is None
        else [(0, int(s), int(e)) for s, e in itertools.pairwise(cu_seqlens.tolist())]
    )
    shape = (len(bounds), v.shape[2], q.shape[-1], v.shape[-1])
    states = torch.zeros(shape, dtype=torch.float64) if state is None else state.double()
    outs, finals = [[None] * q.shape[1] for _ in range(q.shape[0])], []
    for n, (b, start, end) in enumerate(bounds):
        s = states[n]
        for t in range(start, end):
            s = s * g[b, t].exp()[:, None, None]
            delta = (v[b, t] - (s * k[b, t][:, :, None]).sum(-2)) * beta[b, t][:, None]
            s = s + k[b, t][:, :, None] * delta[:, None, :]
            outs[b][t] = (s * q[b, t][:, :, None]).sum(-2)
        finals.append(s)
    out = torch.stack([torch.stack(row) for row in outs])
    return out, torch.stack(finals)


def make_inputs(batch, length, key_heads, heads, dim, dtype, sequences=None, state=True, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    q = randn(batch, length, key_heads, dim).to(dtype)
    k = randn(batch, length, key_heads, dim).to(dtype)
    v = randn(batch, length, heads, dim).to(dtype)
    # slow decays, so the state carries information across several chunks
    g = -torch.rand(batch, length, heads, generator=gen) * 0.1
    beta = torch.rand(batch, length, heads, generator=gen)
    n = batch if sequences is None else sequences
    s = randn(n, heads, dim, dim) * 0.5 if state else None
    return q, k, v, g, beta, s


def check_close(name, got, want, dtype):
    abs_err, rel_err = max_errors(got, want)
    scale = max(1.0, float(want.abs().max()))
    assert abs_err <= TOL[dtype] * scale, f"{name}: max abs {abs_err:.3g}, max rel {rel_err:.3g}"


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize(
    ("length", "dtype"),
    [(n, torch.float32) for n in (1, CHUNK - 1, CHUNK + 1, 3 * CHUNK + 5)]
    + [(3 * CHUNK + 5, torch.bfloat16)],
    ids=str,
)
def test_chunked_matches_float64_oracle(length, dtype, implementation):
    q, k, v, g, beta, s = make_inputs(2, length, 1, 2, 128, dtype)
    out, final = gdr.chunk_gated_delta_rule(
        q, k, v, g, beta, s, None, CHUNK, True, None, implementation
    )
    assert out.dtype == dtype and out.shape == v.shape
    assert final.dtype == torch.float32 and final.shape == s.shape
    want_out, want_final = oracle(q, k, v, g, beta, s)
    check_close("o", out, want_out, dtype)
    check_close("final state", final, want_final, dtype)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_packed_sequences_each_start_from_their_own_state(implementation):
    # an empty sequence (keeps its initial state), one inside a chunk, one crossing two boundaries
    cu = torch.tensor([0, 5, 5, 40, 2 * CHUNK + 45], dtype=torch.int32)
    q, k, v, g, beta, s = make_inputs(1, int(cu[-1]), 2, 4, 64, torch.float32, sequences=4)
    out, final = gdr.chunk_gated_delta_rule(
        q, k, v, g, beta, s, cu, CHUNK, True, None, implementation
    )
    want_out, want_final = oracle(q, k, v, g, beta, s, cu)
    check_close("o", out, want_out, torch.float32)
    check_close("final states", final, want_final, torch.float32)
    torch.testing.assert_close(final[1], s[1])


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tokens", [1, 3])
def test_decode_matches_float64_oracle(tokens, dtype, implementation):
    q, k, v, g, beta, s = make_inputs(3, tokens, 2, 4, 128, dtype)
    out, state = gdr.recurrent_gated_delta_rule(q, k, v, g, beta, s, True, None, implementation)
    want_out, want_state = oracle(q, k, v, g, beta, s)
    check_close("o", out, want_out, dtype)
    check_close("state", state, want_state, dtype)


def _grads_vs_oracle(op, dtype, *, cu=None, sequences=None, length=CHUNK + 9, **kwargs):
    inputs = make_inputs(1 if cu is not None else 2, length, 1, 2, 64, dtype, sequences=sequences)
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    out, final = op(*leaves, **kwargs)
    gen = torch.Generator().manual_seed(1)
    d_out = torch.randn(out.shape, generator=gen).to(out.dtype)
    d_final = torch.randn(final.shape, generator=gen)
    torch.autograd.backward((out, final), (d_out, d_final))
    ref = [x.detach().double().requires_grad_() for x in inputs]
    want_out, want_final = oracle(*ref, cu)
    torch.autograd.backward((want_out, want_final), (d_out.double(), d_final.double()))
    for name, got, want in zip(("q", "k", "v", "g", "beta", "state"), leaves, ref, strict=True):
        check_close(f"d{name}", got.grad, want.grad, dtype)


@pytest.mark.parametrize(
    ("dtype", "implementation"),
    [
        (torch.float32, "xla"),
        (torch.float32, "pallas"),
        pytest.param(torch.bfloat16, "pallas", marks=pytest.mark.slow),
    ],
    ids=str,
)
def test_chunked_gradients_match_float64_oracle(dtype, implementation):
    _grads_vs_oracle(
        gdr.chunk_gated_delta_rule,
        dtype,
        chunk_size=CHUNK,
        use_qk_l2norm=True,
        implementation=implementation,
    )


@pytest.mark.slow
@pytest.mark.parametrize("implementation", ["pallas"])
def test_packed_gradients_match_float64_oracle(implementation):
    cu = torch.tensor([0, 7, 7, CHUNK + 20], dtype=torch.int32)
    _grads_vs_oracle(
        lambda *xs, **kw: gdr.chunk_gated_delta_rule(*xs, cu, **kw),
        torch.float32,
        cu=cu,
        sequences=3,
        length=CHUNK + 20,
        chunk_size=CHUNK,
        use_qk_l2norm=True,
        implementation=implementation,
    )


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_decode_gradients_match_float64_oracle(implementation):
    _grads_vs_oracle(
        gdr.recurrent_gated_delta_rule,
        torch.float32,
        length=2,
        use_qk_l2norm=True,
        implementation=implementation,
    )


@pytest.mark.parametrize(
    ("dtype", "l2norm", "implementation"),
    [
        (torch.float32, True, "xla"),
        (torch.float32, True, "pallas"),
        (torch.bfloat16, True, "pallas"),
        (torch.float32, False, "pallas"),
    ],
    ids=str,
)
def test_equals_transformers_torch_fallbacks(dtype, l2norm, implementation):
    from transformers.models.qwen3_next import modeling_qwen3_next as stock

    q, k, v, g, beta, s = make_inputs(2, 70, 2, 4, 64, dtype)
    if not l2norm:  # unnormalised keys make the delta rule unstable over long sequences
        q, k = q * 0.1, k * 0.1
    want = stock.torch_chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=s, output_final_state=True, use_qk_l2norm_in_kernel=l2norm
    )
    got = gdr.chunk_gated_delta_rule(
        q, k, v, g, beta, s, use_qk_l2norm=l2norm, implementation=implementation
    )
    for name, a, b in zip(("o", "final state"), got, want, strict=True):
        assert a.dtype == b.dtype, name
        check_close(name, a, b, dtype)
    step = [x[:, :1] for x in (q, k, v, g, beta)]
    want = stock.torch_recurrent_gated_delta_rule(
        *step, initial_state=s, output_final_state=True, use_qk_l2norm_in_kernel=l2norm
    )
    got = gdr.recurrent_gated_delta_rule(
        *step, s, use_qk_l2norm=l2norm, implementation=implementation
    )
    for name, a, b in zip(("decode o", "decode state"), got, want, strict=True):
        assert a.dtype == b.dtype, name
        check_close(name, a, b, dtype)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_float64_gradcheck(implementation):
    inputs = make_inputs(1, 5, 1, 2, 8, torch.float64, seed=3)
    leaves = tuple(x.double().requires_grad_() for x in inputs)
    assert torch.autograd.gradcheck(
        lambda *xs: gdr.chunk_gated_delta_rule(
            *xs, chunk_size=16, use_qk_l2norm=True, implementation=implementation
        ),
        leaves,
    )
    assert torch.autograd.gradcheck(
        lambda *xs: gdr.recurrent_gated_delta_rule(
            *xs, use_qk_l2norm=True, implementation=implementation
        ),
        leaves,
    )
    assert not jax.config.jax_enable_x64, "the global x64 flag must stay off"


@pytest.mark.slow
def test_opcheck():
    q, k, v, g, beta, s = (x.requires_grad_() for x in make_inputs(1, 20, 1, 2, 16, torch.float32))
    cu = torch.tensor([0, 9, 20], dtype=torch.int32)
    s2 = torch.randn(2, 2, 16, 16, requires_grad=True)
    for op, args in (
        (gdr.chunk_gated_delta_rule, (q, k, v, g, beta, s, None, 16, True)),
        (gdr.chunk_gated_delta_rule, (q, k, v, g, beta, s2, cu, 16, True)),
        (gdr.recurrent_gated_delta_rule, (q[:, :2], k[:, :2], v[:, :2], g[:, :2], beta[:, :2], s)),
    ):
        result = torch.library.opcheck(op.op, args)
        assert set(result.values()) == {"SUCCESS"}, result


def test_no_initial_state_is_zeros():
    q, k, v, g, beta, _ = make_inputs(1, 10, 1, 1, 16, torch.float32)
    out, final = gdr.chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=16)
    want_out, want_final = oracle(q, k, v, g, beta, l2norm=False)
    check_close("o", out, want_out, torch.float32)
    check_close("final", final, want_final, torch.float32)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: {**a, "k": a["k"][:, :, :, :8]}, "k has shape"),
        (lambda a: {**a, "v": a["v"][:, :, :3]}, "HV a multiple of q/k's 2 heads"),
        (lambda a: {**a, "g": a["g"][:, :-1]}, r"g has shape .* it must be \[B, T, HV\]"),
        (lambda a: {**a, "initial_state": a["initial_state"][:1]}, "initial_state has shape"),
        (lambda a: {**a, "cu_seqlens": torch.tensor([0, 4])}, "batch of one; got batch 2"),
        (lambda a: {**a, "cu_seqlens": torch.tensor([0.0, 4.0])}, "cu_seqlens has dtype"),
        (lambda a: {**a, "chunk_size": 0}, "chunk_size=0"),
        (lambda a: {**a, "q": a["q"].int()}, "q has dtype int32"),
    ],
)
def test_bad_inputs_are_refused_with_the_reason(change, message):
    q, k, v, g, beta, s = make_inputs(2, 6, 2, 4, 16, torch.float32)
    args = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": s}
    with pytest.raises(KernelInputError, match=message):
        gdr.jax.chunk_gated_delta_rule(**{n: _jax(x) for n, x in change(args).items()})


def _jax(x):
    return x.numpy() if isinstance(x, torch.Tensor) else x


def test_pallas_refuses_an_untileable_chunk_and_long_decode():
    q, k, v, g, beta, s = make_inputs(1, 20, 1, 1, 16, torch.float32)
    with pytest.raises(NoImplementationError, match="chunk=24 must be a positive multiple of 16"):
        gdr.chunk_gated_delta_rule(q, k, v, g, beta, s, None, 24, implementation="pallas")
    with pytest.raises(NoImplementationError, match="unrolls at most 16"):
        gdr.recurrent_gated_delta_rule(q, k, v, g, beta, s, implementation="pallas")


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_chunked_backward_on_cpu_runs_no_custom_call(implementation):
    """The chunked form's gradient is plain XLA on CPU: LAPACK's triangular solve (a custom call
    that waits on XLA's intra-op pool from inside it) deadlocked a model's backward on two cores."""
    q, k, v, g, beta, s = (_jax(x) for x in make_inputs(1, CHUNK + 5, 2, 4, 16, torch.float32))

    def loss(q, k, v, g, beta, s):
        out, final = gdr.jax.chunk_gated_delta_rule(
            q, k, v, g, beta, s, chunk_size=CHUNK, implementation=implementation
        )
        return out.sum() + final.sum()

    grad = jax.jit(jax.grad(loss, argnums=tuple(range(6))))
    hlo = grad.lower(q, k, v, g, beta, s).compile().as_text()
    assert "custom-call" not in hlo


TPU_CHUNK = 64  # the kernel's default chunk, the block a TPU runs


def test_pallas_backward_matches_vjp_of_the_reference():
    """The Pallas backward (reverse-chunk kernel) against jax.vjp of the XLA reference (the
    token-by-token recurrence) at the TPU chunk (64): every input's gradient with both
    cotangents random, GQA (two value heads per q/k head), packed sequences (one inside a chunk,
    an empty one, one across two chunk edges) with their own initial states, no L2 norm and an
    explicit scale. The batch layout with the L2 norm is covered against the float64 oracle
    above."""
    cu = jnp.array([0, 5, 5, 140], jnp.int32)
    q, k, v, g, beta, s = make_inputs(1, 140, 2, 4, 64, torch.float32, sequences=3, seed=2)
    args = [_jax(x) for x in (q * 0.1, k * 0.1, v, g, beta, s)]  # unnormalised: keep it stable

    keys = jax.random.split(jax.random.PRNGKey(1), 2)
    cotangents = (
        jax.random.normal(keys[0], v.shape),
        jax.random.normal(keys[1], s.shape),
    )

    def kernel(*xs):
        return gdr.jax.chunk_gated_delta_rule(
            *xs, cu, chunk_size=TPU_CHUNK, scale=0.3, implementation="pallas"
        )

    def reference(*xs):
        return gdr.jax.reference.gated_delta_rule(*xs, cu, scale=0.3)

    @functools.partial(jax.jit, static_argnums=0)
    def run(f, *xs):
        outs, vjp = jax.vjp(f, *xs)
        return outs, vjp(cotangents)

    (out, final), got = run(kernel, *args)
    (want_out, want_final), want = run(reference, *args)
    names = ("o", "final", "dq", "dk", "dv", "dg", "dbeta", "dinitial_state")
    pairs = [(out, want_out), (final, want_final), *zip(got, want, strict=True)]
    for name, (a, b) in zip(names, pairs, strict=True):
        a, b = (torch.from_numpy(np.asarray(x)) for x in (a, b))
        check_close(name, a, b, torch.float32)


@pytest.mark.tpu_compile
@pytest.mark.parametrize("generation", ["v5e", "v6e"])
def test_pallas_backward_compiles_for_tpu(generation):
    """Forward + backward with packed sequences, initial states and GQA for TPU generations
    without a TPU (Mosaic lowers both kernels; the compile matrix covers the unpacked 8k cells)."""
    from kernel_hub.bench.cases import KernelCase
    from kernel_hub.bench.compile_check import compile_case

    struct = jax.ShapeDtypeStruct
    tokens, sequences = 300, 3
    qk = struct((1, tokens, 2, 128), jnp.bfloat16)
    gates = struct((1, tokens, 4), jnp.float32)
    case = KernelCase(
        name="packed-300-gqa",
        fn=gdr.jax.chunk_gated_delta_rule,
        args=(
            qk,
            qk,
            struct((1, tokens, 4, 128), jnp.bfloat16),
            gates,
            gates,
            struct((sequences, 4, 128, 128), jnp.float32),
            struct((sequences + 1,), jnp.int32),
        ),
        kwargs={"use_qk_l2norm": True},
        differentiable=(0, 1, 2, 3, 4, 5),
    )
    result = compile_case("gated-delta-rule", case, generation, "backward")
    assert result.ok, f"{generation}: {result.error}"
