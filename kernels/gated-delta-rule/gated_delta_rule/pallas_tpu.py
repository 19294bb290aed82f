"""Pallas TPU gated delta rule: the chunked form (prefill, training forward) and the recurrent
step (decode).

Chunked: grid (batch, value head, chunk); the chunk axis runs in order and carries the f32 [K, V]
state in VMEM. Per chunk the unit-lower-triangular system of the UT transform is solved by forward
substitution over its rows (what ``solve_triangular`` does in Transformers' fallback), then the
chunk's output and the next state are matmuls on the MXU. Which sequence a chunk belongs to and
whether it starts it come in as scalar-prefetch arrays (``layout.Plan``): the state is reset to
that sequence's initial state, and the sequence's final state block is rewritten after every chunk
(the last write stays). q/k heads are shared by ``HV // HK`` value heads through the index maps.
g and beta travel lane-dense as ``[.., chunks, 1, C]`` rows; the in-chunk cumulative sum of g is
taken in the kernel.

Backward: the forward also writes the f32 state entering every chunk (``[B, HV, chunks, K, V]``);
a second kernel walks the chunks in reverse on the same grid, carrying the gradient of the state
in VMEM (reset to the final state's gradient where a chunk ends its sequence, handed to the
initial state's gradient where it starts one). Per chunk it recomputes the forward substitution
and solves the transposed system by backward substitution in VMEM, and writes the gradients of
q, k (per value head; XLA sums each q/k head's group), v, g and beta.

Recurrent: grid (batch, value head); the few tokens of a decode step are unrolled, the state is
read and written once (aliased to the initial state, so a donated cache buffer is updated in
place).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernel_hub.kernel_api import tiling

from .layout import Plan
from .reference import recurrence, repeat_heads

HIGHEST = jax.lax.Precision.HIGHEST
MAX_DECODE_TOKENS = 16


@dataclass(frozen=True)
class ChunkConfig:
    """Tokens per chunk: a multiple of 16 (the bf16 sublane tile; ``tiling.chunk_problem``)."""

    chunk: int = 64


def _dot(a, b):
    return jnp.dot(a, b, precision=HIGHEST, preferred_element_type=a.dtype)


def _dot_t(a, b, contract: int):
    """a^T b (contract=0) or a b^T (contract=1) without materialising the transpose."""
    dims = (((0,), (0,)), ((), ())) if contract == 0 else (((1,), (1,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, precision=HIGHEST, preferred_element_type=a.dtype)


def _iota(chunk: int):
    row = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
    return row, col


def _column(row_vector, chunk: int):
    """A [1, chunk] row as a [chunk, 1] column (select on the diagonal, sum along the lanes):
    per-token vectors live in HBM as rows, since a [.., L, 1] array pads its lanes 128-fold."""
    row, col = _iota(chunk)
    return jnp.sum(jnp.where(row == col, row_vector, 0.0), axis=1, keepdims=True)


def _row(column, chunk: int):
    """A [chunk, 1] column as a [1, chunk] row (the transpose of ``_column``)."""
    row, col = _iota(chunk)
    return jnp.sum(jnp.where(row == col, column, 0.0), axis=0, keepdims=True)


def _chunk_terms(g_row, beta_row, chunk: int):
    """The chunk's in-chunk cumulative log decay as a column and a row, beta as a column, and the
    masked pairwise decay ``exp(cum_i - cum_j)`` (i >= j, else 0)."""
    row, col = _iota(chunk)
    cum = jnp.sum(jnp.where(col <= row, g_row, 0.0), axis=1, keepdims=True)
    cum_row = _row(cum, chunk)
    decay = jnp.exp(jnp.where(row >= col, cum - cum_row, -jnp.inf))
    return cum, cum_row, _column(beta_row, chunk), decay


def _solve(k, v, beta, cum, decay, kk, system_ref, solved_ref):
    """The UT transform's forward substitution: ``(I + A) X = [v beta | k beta exp(cum)]`` with
    ``A = tril(beta k k^T decay, -1)``; returns X ``[C, V + K]`` (A is left in ``system_ref``)."""
    chunk = k.shape[0]
    row, col = _iota(chunk)
    system_ref[...] = jnp.where(row > col, beta * kk * decay, 0.0)
    solved_ref[...] = jnp.concatenate([v * beta, k * (beta * jnp.exp(cum))], axis=1)

    # Row i of the solution is rhs_i - sum_{j<i} A_ij x_j (A is zero on and above the diagonal,
    # so the not-yet-solved rows contribute nothing).
    def substitute(i, carry):
        a_i = system_ref[pl.ds(i, 1), :]
        solved_ref[pl.ds(i, 1), :] = solved_ref[pl.ds(i, 1), :] - _dot(a_i, solved_ref[...])
        return carry

    jax.lax.fori_loop(1, chunk, substitute, 0)
    return solved_ref[...]


def _chunk_kernel(
    sequence_ref,
    starts_ref,
    q_ref,
    k_ref,
    v_ref,
    g_ref,
    beta_ref,
    init_ref,
    o_ref,
    final_ref,
    *rest,
):
    *entering_ref, state_ref, system_ref, solved_ref = rest
    acc = state_ref.dtype
    step = pl.program_id(0) * pl.num_programs(2) + pl.program_id(2)

    @pl.when(starts_ref[step] > 0)
    def _():
        state_ref[...] = init_ref[...].astype(acc)

    q, k, v = (r[...].astype(acc) for r in (q_ref, k_ref, v_ref))
    chunk, width = q.shape[0], v.shape[1]
    cum, _, beta, decay = _chunk_terms(g_ref[...], beta_ref[...], chunk)
    solved = _solve(k, v, beta, cum, decay, _dot_t(k, k, 1), system_ref, solved_ref)
    new_values, k_cumdecay = solved[:, :width], solved[:, width:]
    state = state_ref[...]
    if entering_ref:  # saved for the backward
        entering_ref[0][...] = state
    v_new = new_values - _dot(k_cumdecay, state)
    row, col = _iota(chunk)
    attn = jnp.where(row >= col, _dot_t(q, k, 1) * decay, 0.0)
    o_ref[...] = (_dot(q * jnp.exp(cum), state) + _dot(attn, v_new)).astype(o_ref.dtype)
    last = cum[chunk - 1 :, :]
    state = state * jnp.exp(last) + _dot_t(k * jnp.exp(last - cum), v_new, 0)
    state_ref[...] = state
    final_ref[...] = state.astype(final_ref.dtype)


def _rows(x, chunk: int):
    """[B, H, L] per-token values as lane-dense rows [B, H, chunks, 1, chunk]."""
    batch, heads, length = x.shape
    return x.reshape(batch, heads, length // chunk, 1, chunk)


def _chunk_forward(
    q, k, v, g, beta, initial_state, p: Plan, config: ChunkConfig, out_dtype, interpret, save=False
):
    """o, final states and, with ``save``, the f32 state entering every chunk
    ``[B, HV, chunks, K, V]``."""
    batch, heads, length = g.shape
    key_heads, key_dim, value_dim = q.shape[1], q.shape[-1], v.shape[-1]
    chunk = config.chunk
    chunks = length // chunk
    groups = heads // key_heads
    acc = initial_state.dtype
    sequences = initial_state.shape[0]

    def qk_map(b, h, c, *_):
        return (b, h // groups, c, 0)

    def token_map(b, h, c, *_):
        return (b, h, c, 0)

    def row_map(b, h, c, *_):
        return (b, h, c, 0, 0)

    def state_map(b, h, c, sequence, _):
        return (sequence[b * chunks + c], h, 0, 0)

    itemsize = q.dtype.itemsize
    tokens = batch * heads * length
    state_bytes = key_dim * value_dim * acc.itemsize
    cost = pl.CostEstimate(
        # k k^T, q k^T, the solve, W S, q S, attn v_new, k^T v_new per chunk
        flops=tokens * (2 * chunk * (2 * key_dim + 2 * value_dim + key_dim))
        + tokens * 6 * key_dim * value_dim,
        transcendentals=tokens * (chunk + 2),
        bytes_accessed=2 * batch * key_heads * length * key_dim * itemsize
        + tokens * value_dim * (v.dtype.itemsize + jnp.dtype(out_dtype).itemsize)
        + tokens * 2 * 4
        + 2 * sequences * heads * state_bytes
        + (batch * heads * chunks * state_bytes if save else 0),
    )
    state_spec = pl.BlockSpec((None, None, key_dim, value_dim), state_map)
    row_spec = pl.BlockSpec((None, None, None, 1, chunk), row_map)
    out_specs = [pl.BlockSpec((None, None, chunk, value_dim), token_map), state_spec]
    out_shape = [
        jax.ShapeDtypeStruct((batch, heads, length, value_dim), out_dtype),
        jax.ShapeDtypeStruct(initial_state.shape, acc),
    ]
    if save:
        out_specs.append(pl.BlockSpec((None, None, None, key_dim, value_dim), row_map))
        out_shape.append(jax.ShapeDtypeStruct((batch, heads, chunks, key_dim, value_dim), acc))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(batch, heads, chunks),
        in_specs=[
            pl.BlockSpec((None, None, chunk, key_dim), qk_map),
            pl.BlockSpec((None, None, chunk, key_dim), qk_map),
            pl.BlockSpec((None, None, chunk, value_dim), token_map),
            row_spec,
            row_spec,
            state_spec,
        ],
        out_specs=out_specs,
        scratch_shapes=[
            pltpu.VMEM((key_dim, value_dim), acc),
            pltpu.VMEM((chunk, chunk), acc),
            pltpu.VMEM((chunk, value_dim + key_dim), acc),
        ],
    )
    outputs = pl.pallas_call(
        _chunk_kernel,
        grid_spec=grid_spec,
        out_shape=out_shape,
        compiler_params=tiling.compiler_params("parallel", "parallel", "arbitrary"),
        cost_estimate=cost,
        interpret=interpret,
        name="chunk_gated_delta_rule",
    )(
        p.chunk_sequence.reshape(-1),
        p.chunk_starts.reshape(-1),
        q,
        k,
        v,
        _rows(g.astype(acc), chunk),
        _rows(beta.astype(acc), chunk),
        initial_state,
    )
    return tuple(outputs)


def _chunk_backward_kernel(
    sequence_ref,
    ends_ref,
    q_ref,
    k_ref,
    v_ref,
    g_ref,
    beta_ref,
    entering_ref,
    d_out_ref,
    d_final_ref,
    dq_ref,
    dk_ref,
    dv_ref,
    dg_ref,
    dbeta_ref,
    dinit_ref,
    dstate_ref,
    system_ref,
    solved_ref,
    grad_ref,
):
    """One chunk of the backward, chunks walked last to first: the gradient of the state leaving
    the chunk is carried in VMEM (taken from the final state's gradient when the chunk ends its
    sequence), the state entering it was saved by the forward, the rest is recomputed."""
    acc = dstate_ref.dtype
    chunks = pl.num_programs(2)
    step = pl.program_id(0) * chunks + chunks - 1 - pl.program_id(2)

    @pl.when(ends_ref[step] > 0)
    def _():
        dstate_ref[...] = d_final_ref[...].astype(acc)

    q, k, v = (r[...].astype(acc) for r in (q_ref, k_ref, v_ref))
    chunk, width = q.shape[0], v.shape[1]
    row, col = _iota(chunk)
    lower = row >= col
    cum, cum_row, beta, decay = _chunk_terms(g_ref[...], beta_ref[...], chunk)
    kk, qk = _dot_t(k, k, 1), _dot_t(q, k, 1)
    solved = _solve(k, v, beta, cum, decay, kk, system_ref, solved_ref)
    new_values, k_cumdecay = solved[:, :width], solved[:, width:]
    state, leaving = entering_ref[...], dstate_ref[...]  # state in, gradient of state out
    d_out = d_out_ref[...].astype(acc)
    v_new = new_values - _dot(k_cumdecay, state)
    attn = jnp.where(lower, qk * decay, 0.0)
    reads = jnp.exp(cum)  # how the entering state reaches each token's output
    last = cum[chunk - 1 :, :]
    adds = jnp.exp(last - cum)  # how each token adds to the leaving state
    k_adds = k * adds
    # o = (q reads) S + attn v_new;  S_out = S exp(last) + (k adds)^T v_new;  v_new = U - W S
    d_v_new = _dot_t(attn, d_out, 0) + _dot(k_adds, leaving)
    d_entering = (
        _dot_t(q * reads, d_out, 0) + leaving * jnp.exp(last) - _dot_t(k_cumdecay, d_v_new, 0)
    )
    d_attn = jnp.where(lower, _dot_t(d_out, v_new, 1), 0.0)
    d_qk = d_attn * decay
    d_reads = _dot_t(d_out, state, 1)  # gradient of q reads, [C, K]
    d_adds = _dot_t(v_new, leaving, 1)  # gradient of k adds, [C, K]
    dq = _dot(d_qk, k) + d_reads * reads
    dk = _dot_t(d_qk, q, 0) + d_adds * adds
    # The transposed solve: d_rhs = (I + A)^-T dX by backward substitution; row i takes
    # dX_i - sum_{j>i} A_ji d_rhs_j, with A^T built directly (strictly upper).
    grad_ref[...] = jnp.concatenate([d_v_new, -_dot_t(d_v_new, state, 1)], axis=1)
    beta_row = beta_ref[...]
    upper = jnp.exp(jnp.where(col > row, cum_row - cum, -jnp.inf))
    system_ref[...] = jnp.where(col > row, beta_row * kk * upper, 0.0)

    def substitute(t, carry):
        i = chunk - 2 - t
        a_i = system_ref[pl.ds(i, 1), :]
        grad_ref[pl.ds(i, 1), :] = grad_ref[pl.ds(i, 1), :] - _dot(a_i, grad_ref[...])
        return carry

    jax.lax.fori_loop(0, chunk - 1, substitute, 0)
    d_rhs = grad_ref[...]
    d_rhs_v, d_rhs_k = d_rhs[:, :width], d_rhs[:, width:]
    d_system = jnp.where(row > col, -_dot_t(d_rhs, solved, 1), 0.0)  # gradient of A
    k_rhs = jnp.sum(d_rhs_k * k, axis=1, keepdims=True) * reads  # per row, without beta
    d_system_kk = d_system * decay  # A = beta_i (k k^T)_ij decay_ij
    d_kk = d_system_kk * beta
    dk = dk + d_rhs_k * (beta * reads) + _dot(d_kk, k) + _dot_t(d_kk, k, 0)
    d_beta = jnp.sum(d_rhs_v * v, axis=1, keepdims=True) + k_rhs
    d_beta = d_beta + jnp.sum(d_system_kk * kk, axis=1, keepdims=True)
    # cum: through the pairwise decay (cum_i - cum_j), the reads, the adds (last - cum_i), the
    # right-hand side's exp(cum) and the state passed through (exp(last))
    d_log = (d_attn * qk + d_system * beta * kk) * decay
    d_cum = jnp.sum(d_log, axis=1, keepdims=True) - _column(
        jnp.sum(d_log, axis=0, keepdims=True), chunk
    )
    d_adds_sum = jnp.sum(d_adds * k_adds, axis=1, keepdims=True)
    d_cum = d_cum + jnp.sum(d_reads * q * reads, axis=1, keepdims=True) + k_rhs * beta
    d_cum = d_cum - d_adds_sum
    d_last = jnp.sum(d_adds_sum, keepdims=True) + jnp.sum(leaving * state, keepdims=True) * jnp.exp(
        last
    )
    d_cum = d_cum + jnp.where(row[:, :1] == chunk - 1, d_last, 0.0)
    dstate_ref[...] = d_entering
    dinit_ref[...] = d_entering.astype(dinit_ref.dtype)
    dq_ref[...] = dq.astype(dq_ref.dtype)
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = (d_rhs_v * beta).astype(dv_ref.dtype)
    # cum is the in-chunk running sum of g: g_j's gradient sums d_cum over the rows i >= j
    dg_ref[...] = jnp.sum(jnp.where(lower, d_cum, 0.0), axis=0, keepdims=True)
    dbeta_ref[...] = _row(d_beta, chunk)


def _chunk_backward(
    q, k, v, g, beta, initial_state, p: Plan, entering, d_out, d_final, config, interpret
):
    """Gradients of ``_chunk_forward`` in (q, k, v, g, beta, initial_state): one Pallas pass over
    the chunks in reverse; q/k gradients come per value head and XLA sums each group's."""
    batch, heads, length = g.shape
    key_heads, key_dim, value_dim = q.shape[1], q.shape[-1], v.shape[-1]
    chunk = config.chunk
    chunks = length // chunk
    groups = heads // key_heads
    acc = initial_state.dtype

    def qk_map(b, h, c, *_):
        return (b, h // groups, chunks - 1 - c, 0)

    def token_map(b, h, c, *_):
        return (b, h, chunks - 1 - c, 0)

    def row_map(b, h, c, *_):
        return (b, h, chunks - 1 - c, 0, 0)

    def state_map(b, h, c, sequence, _):
        return (sequence[b * chunks + chunks - 1 - c], h, 0, 0)

    # a chunk ends its sequence when it is its row's last or the next chunk starts another one
    ends = jnp.concatenate(
        [p.chunk_starts[:, 1:], jnp.ones_like(p.chunk_starts[:, :1])], axis=1
    ).reshape(-1)
    state_spec = pl.BlockSpec((None, None, key_dim, value_dim), state_map)
    row_spec = pl.BlockSpec((None, None, None, 1, chunk), row_map)
    key_spec = pl.BlockSpec((None, None, chunk, key_dim), token_map)
    value_spec = pl.BlockSpec((None, None, chunk, value_dim), token_map)
    inputs = [
        q,
        k,
        v,
        _rows(g.astype(acc), chunk),
        _rows(beta.astype(acc), chunk),
        entering,
        d_out,
        d_final.astype(acc),
    ]
    out_shape = [
        jax.ShapeDtypeStruct((batch, heads, length, key_dim), acc),
        jax.ShapeDtypeStruct((batch, heads, length, key_dim), acc),
        jax.ShapeDtypeStruct(v.shape, v.dtype),
        jax.ShapeDtypeStruct((batch, heads, chunks, 1, chunk), acc),
        jax.ShapeDtypeStruct((batch, heads, chunks, 1, chunk), acc),
        jax.ShapeDtypeStruct(initial_state.shape, acc),
    ]
    tokens = batch * heads * length
    cost = pl.CostEstimate(
        # per chunk, C x C x K: k k^T, q k^T, d_qk k, d_qk^T q, d_kk k, d_kk^T k; C x C x V:
        # attn^T dO, dO v_new^T; C x C x (V + K): both substitutions and d_rhs X^T; C x K x V:
        # W S, (k adds) dS, (q reads)^T dO, W^T dv_new, dO S^T, v_new dS^T, dv_new S^T
        flops=tokens * 2 * (chunk * (6 * key_dim + 2 * value_dim + 3 * (key_dim + value_dim)))
        + tokens * 2 * 7 * key_dim * value_dim,
        transcendentals=tokens * (2 * chunk + 2),
        bytes_accessed=sum(a.size * a.dtype.itemsize for a in inputs)
        + sum(math.prod(o.shape) * o.dtype.itemsize for o in out_shape),
    )
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(batch, heads, chunks),
        in_specs=[
            pl.BlockSpec((None, None, chunk, key_dim), qk_map),
            pl.BlockSpec((None, None, chunk, key_dim), qk_map),
            value_spec,
            row_spec,
            row_spec,
            pl.BlockSpec((None, None, None, key_dim, value_dim), row_map),
            value_spec,
            state_spec,
        ],
        out_specs=[key_spec, key_spec, value_spec, row_spec, row_spec, state_spec],
        scratch_shapes=[
            pltpu.VMEM((key_dim, value_dim), acc),
            pltpu.VMEM((chunk, chunk), acc),
            pltpu.VMEM((chunk, value_dim + key_dim), acc),
            pltpu.VMEM((chunk, value_dim + key_dim), acc),
        ],
    )
    dq, dk, dv, dg, dbeta, dinit = pl.pallas_call(
        _chunk_backward_kernel,
        grid_spec=grid_spec,
        out_shape=out_shape,
        compiler_params=tiling.compiler_params("parallel", "parallel", "arbitrary"),
        cost_estimate=cost,
        interpret=interpret,
        name="chunk_gated_delta_rule_backward",
    )(p.chunk_sequence.reshape(-1), ends, *inputs)

    def per_group_sum(t):
        return t.reshape(batch, key_heads, groups, length, key_dim).sum(axis=2)

    return (
        per_group_sum(dq).astype(q.dtype),
        per_group_sum(dk).astype(k.dtype),
        dv,
        dg.reshape(g.shape).astype(g.dtype),
        dbeta.reshape(beta.shape).astype(beta.dtype),
        dinit.astype(initial_state.dtype),
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10))
def chunk_gated_delta_rule(
    q, k, v, g, beta, initial_state, chunk_sequence, chunk_starts, config, out_dtype, interpret
):
    """Prepared, chunk-aligned inputs (``layout``): q, k [B, HK, L, K] and initial_state
    [N, HV, K, V] in the compute dtype, v [B, HV, L, V], g, beta [B, HV, L], the plan's chunk
    arrays -> (o [B, HV, L, V] in ``out_dtype``, final states [N, HV, K, V])."""
    p = Plan(g.shape[-1], None, None, chunk_sequence, chunk_starts)
    return _chunk_forward(q, k, v, g, beta, initial_state, p, config, out_dtype, interpret)


def _chunk_fwd(
    q, k, v, g, beta, initial_state, chunk_sequence, chunk_starts, config, out_dtype, interpret
):
    p = Plan(g.shape[-1], None, None, chunk_sequence, chunk_starts)
    out, final, entering = _chunk_forward(
        q, k, v, g, beta, initial_state, p, config, out_dtype, interpret, save=True
    )
    inputs = (q, k, v, g, beta, initial_state, chunk_sequence, chunk_starts)
    return (out, final), (*inputs, entering)


def _chunk_bwd(config, out_dtype, interpret, residuals, cotangents):
    *floats, chunk_sequence, chunk_starts, entering = residuals
    p = Plan(floats[3].shape[-1], None, None, chunk_sequence, chunk_starts)
    d_out, d_final = cotangents
    grads = _chunk_backward(*floats, p, entering, d_out, d_final, config, interpret)
    return (*grads, None, None)


chunk_gated_delta_rule.defvjp(_chunk_fwd, _chunk_bwd)


def _decode_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, state_ref, o_ref, new_state_ref):
    acc = new_state_ref.dtype
    s = state_ref[...].astype(acc)
    for t in range(v_ref.shape[0]):
        q_t, k_t = q_ref[:, t : t + 1], k_ref[:, t : t + 1]
        s = s * jnp.exp(g_ref[:, t : t + 1])
        predicted = jnp.sum(s * k_t, axis=0, keepdims=True)
        delta = (v_ref[t : t + 1, :].astype(acc) - predicted) * beta_ref[:, t : t + 1]
        s = s + k_t * delta
        o_ref[t : t + 1, :] = jnp.sum(s * q_t, axis=0, keepdims=True).astype(o_ref.dtype)
    new_state_ref[...] = s


def _decode_forward(q_t, k_t, v, g, beta, state, out_dtype, interpret):
    batch, heads, tokens, value_dim = v.shape
    key_heads, key_dim = q_t.shape[1], q_t.shape[2]
    groups = heads // key_heads
    acc = state.dtype
    state_bytes = batch * heads * key_dim * value_dim * acc.itemsize
    cost = pl.CostEstimate(
        flops=batch * heads * tokens * 8 * key_dim * value_dim,
        transcendentals=batch * heads * tokens,
        bytes_accessed=2 * state_bytes
        + 2 * batch * key_heads * tokens * key_dim * q_t.dtype.itemsize
        + batch * heads * tokens * value_dim * (v.dtype.itemsize + jnp.dtype(out_dtype).itemsize),
    )
    qk_spec = pl.BlockSpec((None, None, key_dim, tokens), lambda b, h: (b, h // groups, 0, 0))
    row_spec = pl.BlockSpec((None, None, 1, tokens), lambda b, h: (b, h, 0, 0))
    state_spec = pl.BlockSpec((None, None, key_dim, value_dim), lambda b, h: (b, h, 0, 0))
    value_spec = pl.BlockSpec((None, None, tokens, value_dim), lambda b, h: (b, h, 0, 0))
    return pl.pallas_call(
        _decode_kernel,
        grid=(batch, heads),
        in_specs=[qk_spec, qk_spec, value_spec, row_spec, row_spec, state_spec],
        out_specs=(value_spec, state_spec),
        out_shape=(
            jax.ShapeDtypeStruct(v.shape, out_dtype),
            jax.ShapeDtypeStruct(state.shape, acc),
        ),
        input_output_aliases={5: 1},
        compiler_params=tiling.compiler_params("parallel", "parallel"),
        cost_estimate=cost,
        interpret=interpret,
        name="recurrent_gated_delta_rule",
    )(q_t, k_t, v, g.reshape(batch, heads, 1, tokens), beta.reshape(batch, heads, 1, tokens), state)


def _xla_decode(q_t, k_t, v, g, beta, state):
    acc = state.dtype
    q, k = (repeat_heads(jnp.moveaxis(x, 3, 1), v.shape[1]) for x in (q_t, k_t))
    out, state = recurrence(
        q,
        k,
        jnp.moveaxis(v, 2, 1).astype(acc),
        jnp.moveaxis(g, 2, 1).astype(acc),
        jnp.moveaxis(beta, 2, 1).astype(acc),
        state,
    )
    return jnp.moveaxis(out, 1, 2), state


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def recurrent_gated_delta_rule(q_t, k_t, v, g, beta, state, out_dtype, interpret):
    """Prepared decode inputs: q, k transposed [B, HK, K, T] and state [B, HV, K, V] in the
    compute dtype, v [B, HV, T, V], g, beta [B, HV, T] -> (o [B, HV, T, V], new state)."""
    return _decode_forward(q_t, k_t, v, g, beta, state, out_dtype, interpret)


def _decode_fwd(q_t, k_t, v, g, beta, state, out_dtype, interpret):
    inputs = (q_t, k_t, v, g, beta, state)
    return _decode_forward(*inputs, out_dtype, interpret), inputs


def _decode_bwd(out_dtype, interpret, residuals, cotangents):
    _, vjp = jax.vjp(_xla_decode, *residuals)
    acc = residuals[-1].dtype
    grads = vjp(tuple(c.astype(acc) for c in cotangents))
    return tuple(grad.astype(x.dtype) for grad, x in zip(grads, residuals, strict=True))


recurrent_gated_delta_rule.defvjp(_decode_fwd, _decode_bwd)
