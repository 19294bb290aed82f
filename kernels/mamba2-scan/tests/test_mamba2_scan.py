"""mamba2-scan: values and gradients against a float64 torch oracle across chunk boundaries,
packed rows (``seq_idx``) and initial states (both implementations, f32 and bf16), exactness
against Transformers' own torch fallbacks, the decode step (per-channel dt/A/D/bias as Transformers
passes them, the z gate), the torch op contract and input errors."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kernel_hub import get_kernel
from kernel_hub.errors import KernelInputError, NoImplementationError
from kernel_hub.testing import max_errors

m2 = get_kernel("mamba2-scan")
CHUNK = 16  # the chunk in these tests: lengths below cross it
HEADS, GROUPS, HEAD_DIM, STATE = 4, 2, 16, 32  # model sizes: the interpret-mode test below
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
IMPLEMENTATIONS = ["xla", "pallas"]


def prepared_dt(dt, dt_bias, limit=(0.0, float("inf"))):
    """Transformers' dt: + bias, softplus, clamp (in dt's dtype), then float64."""
    return torch.clamp(F.softplus(dt + dt_bias.to(dt.dtype)), *limit).double()


def oracle(x, dt, A, B, C, D, state=None, seq_idx=None):
    """Token-by-token scan in float64 on a prepared dt (independent of the kernel's JAX code)."""
    x, A, B, C, D = (t.double() for t in (x, A, B, C, D))
    batch, length, heads, _ = x.shape
    B, C = (t.repeat_interleave(heads // t.shape[2], 2) for t in (B, C))
    s = torch.zeros(batch, heads, x.shape[-1], B.shape[-1], dtype=torch.float64)
    s = s if state is None else state.double().clone()
    ys = []
    for t in range(length):
        keep = torch.ones(batch, dtype=torch.float64)
        if seq_idx is not None and t > 0:
            keep = (seq_idx[:, t] == seq_idx[:, t - 1]).double()
        decay = torch.exp(dt[:, t] * A) * keep[:, None]
        s = s * decay[..., None, None] + (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None]
        ys.append((s * C[:, t, :, None]).sum(-1) + x[:, t] * D[:, None])
    return torch.stack(ys, 1), s


def make_inputs(batch, length, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen) * scale

    return {
        "x": randn(batch, length, HEADS, HEAD_DIM).to(dtype),
        "dt": randn(batch, length, HEADS).to(dtype),
        "A": -torch.exp(randn(HEADS)),
        "B": randn(batch, length, GROUPS, STATE, scale=0.3).to(dtype),
        "C": randn(batch, length, GROUPS, STATE, scale=0.3).to(dtype),
        "D": randn(HEADS),
        "dt_bias": randn(HEADS),
        "initial_states": randn(batch, HEADS, HEAD_DIM, STATE, scale=0.5),
    }


def run(inputs, implementation, seq_idx=None, limit=(0.0, None)):
    i = inputs
    return m2.mamba_chunk_scan_combined(
        i["x"],
        i["dt"],
        i["A"],
        i["B"],
        i["C"],
        i["D"],
        i["dt_bias"],
        i["initial_states"],
        seq_idx,
        chunk_size=CHUNK,
        dt_softplus=True,
        dt_min=limit[0],
        dt_max=limit[1],
        implementation=implementation,
    )


def expected(inputs, seq_idx=None, limit=(0.0, float("inf"))):
    i = inputs
    dt = prepared_dt(i["dt"], i["dt_bias"], limit)
    return oracle(i["x"], dt, i["A"], i["B"], i["C"], i["D"], i["initial_states"], seq_idx)


def jitted(fn, **options):
    """fn with these options as one jitted program (eagerly, each primitive compiles alone)."""
    return jax.jit(functools.partial(fn, **options))


def scaled_error(got, want) -> float:
    """Max abs error over the output's scale (elementwise relative errors blow up near zero)."""
    err, _ = max_errors(got, want)
    return err / float(want.abs().max())


def assert_close(got, want, tol):
    err = scaled_error(got, want)
    assert err <= tol, f"error {err:.2e} of the output scale > {tol}"


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize(
    ("length", "dtype"),
    [
        (1, torch.float32),
        (CHUNK - 1, torch.float32),
        (CHUNK + 1, torch.float32),
        (3 * CHUNK + 5, torch.float32),
        (3 * CHUNK + 5, torch.bfloat16),
    ],
    ids=str,
)
def test_chunked_matches_float64_oracle(length, dtype, implementation):
    inputs = make_inputs(2, length, dtype)
    y, final = run(inputs, implementation)
    want_y, want_final = expected(inputs)
    assert y.dtype == final.dtype == torch.float32  # Transformers' fallback returns float32
    assert y.shape == inputs["x"].shape and final.shape == inputs["initial_states"].shape
    assert_close(y, want_y, TOL[dtype])
    assert_close(final, want_final, TOL[dtype])


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_packed_rows_restart_the_state_and_dt_is_clamped(implementation):
    """Boundaries inside a chunk, on a chunk edge and a one-token sequence; the row's first
    sequence continues the initial state; a dt limit clamps after the softplus."""
    length = 2 * CHUNK + 7
    cuts = [(0, 5), (5, CHUNK), (CHUNK, CHUNK + 1), (CHUNK + 1, length)]
    row = torch.cat([torch.full((e - s,), n) for n, (s, e) in enumerate(cuts)])
    seq_idx = torch.stack([row, torch.zeros(length, dtype=torch.int64)]).to(torch.int32)
    inputs = make_inputs(2, length, torch.float32, seed=1)
    y, final = run(inputs, implementation, seq_idx, limit=(0.1, 1.5))
    want_y, want_final = expected(inputs, seq_idx, limit=(0.1, 1.5))
    assert_close(y, want_y, 1e-4)
    assert_close(final, want_final, 1e-4)


def _gradients(inputs, names, fn):
    leaves = {n: t.detach().clone().requires_grad_(n in names) for n, t in inputs.items()}
    y, final = fn(leaves)
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(y.shape, generator=gen).to(y.dtype)
    loss = (y * weight).sum() + (final**2).sum()
    loss.backward()
    return [leaves[n].grad for n in names]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("dtype", "implementation"),
    [(torch.float32, "pallas"), (torch.bfloat16, "xla")],
    ids=str,
)
def test_gradients_match_float64_oracle(dtype, implementation):
    length = CHUNK + 9
    seq_idx = torch.tensor([[0] * 20 + [1] * (length - 20)] * 2, dtype=torch.int32)
    inputs = make_inputs(2, length, dtype, seed=2)
    names = list(inputs)
    got = _gradients(inputs, names, lambda i: run(i, implementation, seq_idx))
    f64 = {n: t.double() for n, t in inputs.items()}
    want = _gradients(f64, names, lambda i: expected(i, seq_idx))
    for name, g, w in zip(names, got, want, strict=True):
        assert g.dtype == inputs[name].dtype, name
        err = scaled_error(g, w)
        assert err <= TOL[dtype], f"{name}: error {err:.2e} of the gradient's scale"


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_equals_transformers_torch_fallback(implementation):
    from transformers.models.mamba2 import modeling_mamba2 as stock

    inputs = make_inputs(2, 2 * CHUNK + 3, torch.float32, seed=4)
    i = inputs
    want_y, want_final = stock.mamba2_chunk_scan(
        i["x"], i["dt"], i["A"], i["B"], i["C"], CHUNK, D=i["D"], dt_bias=i["dt_bias"],
        initial_states=i["initial_states"], dt_softplus=True, dt_limit=(0.0, 2.0),
        return_final_states=True,
    )  # fmt: skip
    y, final = run(inputs, implementation, limit=(0.0, 2.0))
    torch.testing.assert_close(y, want_y, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(final, want_final, rtol=1e-4, atol=1e-4)

    state = torch.randn(2, HEADS, HEAD_DIM, STATE)
    head_dim_view = (HEADS, HEAD_DIM)
    args = (
        i["x"][:, 0],
        i["dt"][:, 0, :, None].expand(-1, -1, HEAD_DIM),
        i["A"][:, None, None].expand(-1, HEAD_DIM, STATE),
        i["B"][:, 0],
        i["C"][:, 0],
        i["D"][:, None].expand(head_dim_view),
    )
    z = torch.randn(2, HEADS, HEAD_DIM)
    bias = i["dt_bias"][:, None].expand(head_dim_view)
    stock_state = state.clone()
    want = stock.mamba2_selective_state_update(
        stock_state, *args, z=z, dt_bias=bias, dt_softplus=True
    )
    y, new_state = m2.selective_state_update(
        state, *args, z, bias, dt_softplus=True, implementation=implementation
    )
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(new_state, stock_state, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_matches_float64_oracle(dtype, implementation):
    """Sixteen heads (two blocks of eight) and two groups, with the z gate."""
    batch, heads = 3, 16
    gen = torch.Generator().manual_seed(5)
    state = torch.randn(batch, heads, HEAD_DIM, STATE, generator=gen)
    x = torch.randn(batch, heads, HEAD_DIM, generator=gen).to(dtype)
    dt = torch.randn(batch, heads, generator=gen).to(dtype)
    A, D, bias = (torch.randn(heads, generator=gen) for _ in range(3))
    A = -A.exp()
    B, C = (torch.randn(batch, GROUPS, STATE, generator=gen).to(dtype) * 0.3 for _ in range(2))
    z = torch.randn(batch, heads, HEAD_DIM, generator=gen).to(dtype)
    args = (
        dt[..., None].expand(-1, -1, HEAD_DIM),
        A[:, None, None].expand(-1, HEAD_DIM, STATE),
        B,
        C,
        D[:, None].expand(-1, HEAD_DIM),
        z,
        bias[:, None].expand(-1, HEAD_DIM),
    )
    y, new_state = m2.selective_state_update(
        state, x, *args, dt_softplus=True, implementation=implementation
    )
    want_dt = prepared_dt(dt, bias)[:, None]
    want, want_state = oracle(x[:, None], want_dt, A, B[:, None], C[:, None], D, state)
    want = want[:, 0] * F.silu(z.double())
    assert y.dtype == dtype and new_state.dtype == state.dtype
    assert_close(y, want, TOL[dtype])
    assert_close(new_state, want_state, TOL[dtype])


@pytest.mark.slow
def test_pallas_backward_equals_xla_vjp():
    """The Pallas backward (chunks walked in reverse from the forward's saved states) against
    jax.vjp of the XLA chunked form: 3 chunks of 16 (the last ragged), 4 heads in 2 groups, a
    sequence boundary inside a chunk, an initial state and a gradient on the final state."""
    keys = jax.random.split(jax.random.key(3), 11)
    length, heads, groups, width, state = 40, 4, 2, 16, 16
    x = jax.random.normal(keys[0], (1, length, heads, width))
    dt = jax.random.normal(keys[1], (1, length, heads))
    A = -jnp.exp(jax.random.normal(keys[2], (heads,)))
    B, C = (jax.random.normal(k, (1, length, groups, state)) for k in keys[3:5])
    D, dt_bias = (jax.random.normal(k, (heads,)) for k in keys[5:7])
    init = jax.random.normal(keys[7], (1, heads, width, state))
    seq_idx = (jnp.arange(length)[None] >= 21).astype(jnp.int32)
    upstream = (jax.random.normal(keys[8], x.shape), jax.random.normal(keys[9], init.shape))

    def vjp(implementation):
        def run(*args):
            return m2.jax.mamba_chunk_scan_combined(
                *args, seq_idx, chunk_size=16, dt_softplus=True, implementation=implementation
            )

        return jax.vjp(run, x, dt, A, B, C, D, dt_bias, init)[1](upstream)

    # one jitted program each: run eagerly, every primitive of the two backwards compiles alone
    vjp = jax.jit(vjp, static_argnums=0)

    names = ("x", "dt", "A", "B", "C", "D", "dt_bias", "initial_states")
    for name, got, want in zip(names, vjp("pallas"), vjp("xla"), strict=True):
        scale = float(jnp.max(jnp.abs(want)))
        assert float(jnp.max(jnp.abs(got - want))) <= 1e-5 * max(1.0, scale), name


@pytest.mark.slow
def test_pallas_interpret_at_tpu_block_sizes_equals_xla():
    """TPU block sizes (chunk 128, head dim 64, state 128): two chunks and two heads for the
    chunked scan; two 8-head blocks for the decode step."""
    key = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(key[0], (1, 2 * 128, 2, 64), jnp.bfloat16)
    dt = jax.random.normal(key[1], (1, 2 * 128, 2), jnp.bfloat16)
    A = -jnp.exp(jax.random.normal(key[2], (2,)))
    B = jax.random.normal(key[3], (1, 2 * 128, 1, 128), jnp.bfloat16) * 0.3
    C = jax.random.normal(key[4], (1, 2 * 128, 1, 128), jnp.bfloat16) * 0.3
    out = {
        impl: jitted(
            m2.jax.mamba_chunk_scan_combined, chunk_size=128, dt_softplus=True, implementation=impl
        )(x, dt, A, B, C)
        for impl in IMPLEMENTATIONS
    }
    for got, want in zip(out["pallas"], out["xla"], strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-4, atol=2e-4)

    heads = 16
    state = jax.random.normal(key[0], (2, heads, 64, 128))
    x, dt, z = (jax.random.normal(k, (2, heads, 64), jnp.bfloat16) for k in key[1:4])
    A = -jnp.exp(jax.random.normal(key[4], (heads, 64, 128)))
    D, bias = jnp.ones((heads, 64)), jnp.zeros((heads, 64))
    B, C = (0.3 * jax.random.normal(k, (2, 2, 128), jnp.bfloat16) for k in key[:2])
    step = {
        impl: jitted(m2.jax.selective_state_update, dt_softplus=True, implementation=impl)(
            state, x, dt, A, B, C, D, z, bias
        )
        for impl in IMPLEMENTATIONS
    }
    for got, want in zip(step["pallas"], step["xla"], strict=True):
        np.testing.assert_allclose(
            np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=2e-2
        )


def test_opcheck():
    inputs = make_inputs(1, 20, torch.float32)
    i = inputs
    chunk_args = (i["x"], i["dt"], i["A"], i["B"], i["C"], i["D"], i["dt_bias"])
    torch.library.opcheck(m2.mamba_chunk_scan_combined.op, (*chunk_args, None, None, CHUNK, True))
    per_channel = (HEADS, HEAD_DIM)
    decode_args = (
        i["initial_states"],
        i["x"][:, 0],
        i["x"][:, 1],  # a per-channel dt
        i["A"][:, None, None].expand(*per_channel, STATE).contiguous(),
        i["B"][:, 0],
        i["C"][:, 0],
        i["D"][:, None].expand(per_channel).contiguous(),
    )
    torch.library.opcheck(m2.selective_state_update.op, (*decode_args, None, None, True))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"A": torch.zeros(3)}, r"A has shape \(3,\); it must be \[H\] \[4\]"),
        ({"B": torch.zeros(1, 20, 3, STATE)}, r"the 4 heads a multiple of G"),
        ({"D": torch.zeros(4, 3)}, r"D has shape \(4, 3\); it must be \[H\] \[4\]"),
        ({"initial_states": torch.zeros(1, 4, 16, 16)}, r"initial_states .* \[B, H, P, N\]"),
    ],
)
def test_bad_inputs_are_refused_with_the_reason(change, message):
    inputs = {**make_inputs(1, 20, torch.float32), **change}
    with pytest.raises(KernelInputError, match=message):
        run(inputs, None)


def test_bad_options_are_refused():
    inputs = make_inputs(1, 20, torch.float32)
    with pytest.raises(KernelInputError, match=r"dt_limit \(2.0, 1.0\)"):
        run(inputs, None, limit=(2.0, 1.0))
    seq_idx = torch.zeros(1, 20)
    with pytest.raises(KernelInputError, match="seq_idx"):
        run(inputs, None, seq_idx)
    with pytest.raises(NoImplementationError, match="multiple of 16"):
        i = inputs
        m2.mamba_chunk_scan_combined(
            i["x"], i["dt"], i["A"], i["B"], i["C"], chunk_size=24, implementation="pallas"
        )
