"""Pallas TPU gated delta rule: the chunked form (prefill, training forward) and the recurrent
step (decode).

Chunked: grid (batch, value head, chunk); the chunk axis runs in order and carries the f32 [K, V]
state in VMEM. Per chunk the unit-lower-triangular system of the UT transform is solved by forward
substitution over its rows (what ``solve_triangular`` does in Transformers' fallback), then the
chunk's output and the next state are matmuls on the MXU. Which sequence a chunk belongs to and
whether it starts it come in as scalar-prefetch arrays (``layout.Plan``): the state is reset to
that sequence's initial state, and the sequence's final state block is rewritten after every chunk
(the last write stays). q/k heads are shared by ``HV // HK`` value heads through the index maps.

The backward of the chunked form is ``jax.vjp`` of the XLA chunked form (``chunked.py``) on the
same prepared inputs: a Pallas backward is not written yet.

Recurrent: grid (batch, value head); the few tokens of a decode step are unrolled, the state is
read and written once (aliased to the initial state, so a donated cache buffer is updated in
place).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernel_hub.kernel_api import tiling

from . import chunked as xla_chunked
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


def _chunk_kernel(
    sequence_ref,
    starts_ref,
    q_ref,
    k_ref,
    v_ref,
    cum_ref,
    cum_row_ref,
    beta_ref,
    init_ref,
    o_ref,
    final_ref,
    state_ref,
    system_ref,
    solved_ref,
):
    acc = state_ref.dtype
    step = pl.program_id(0) * pl.num_programs(2) + pl.program_id(2)

    @pl.when(starts_ref[step] > 0)
    def _():
        state_ref[...] = init_ref[...].astype(acc)

    q, k, v = (r[...].astype(acc) for r in (q_ref, k_ref, v_ref))
    cum, cum_row, beta = cum_ref[...], cum_row_ref[...], beta_ref[...]
    chunk, width = q.shape[0], v.shape[1]
    row = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
    decay = jnp.exp(jnp.where(row >= col, cum - cum_row, -jnp.inf))
    system_ref[...] = jnp.where(row > col, beta * _dot_t(k, k, 1) * decay, 0.0)
    solved_ref[...] = jnp.concatenate([v * beta, k * (beta * jnp.exp(cum))], axis=1)

    # Forward substitution: row i of the solution is rhs_i - sum_{j<i} A_ij x_j (A is zero on and
    # above the diagonal, so the not-yet-solved rows contribute nothing).
    def substitute(i, carry):
        a_i = system_ref[pl.ds(i, 1), :]
        solved_ref[pl.ds(i, 1), :] = solved_ref[pl.ds(i, 1), :] - _dot(a_i, solved_ref[...])
        return carry

    jax.lax.fori_loop(1, chunk, substitute, 0)
    solved = solved_ref[...]
    new_values, k_cumdecay = solved[:, :width], solved[:, width:]
    state = state_ref[...]
    v_new = new_values - _dot(k_cumdecay, state)
    attn = jnp.where(row >= col, _dot_t(q, k, 1) * decay, 0.0)
    o_ref[...] = (_dot(q * jnp.exp(cum), state) + _dot(attn, v_new)).astype(o_ref.dtype)
    last = cum[chunk - 1 :, :]
    state = state * jnp.exp(last) + _dot_t(k * jnp.exp(last - cum), v_new, 0)
    state_ref[...] = state
    final_ref[...] = state.astype(final_ref.dtype)


def _chunk_forward(
    q, k, v, g, beta, initial_state, p: Plan, config: ChunkConfig, out_dtype, interpret
):
    batch, heads, length = g.shape
    key_heads, key_dim, value_dim = q.shape[1], q.shape[-1], v.shape[-1]
    chunk = config.chunk
    chunks = length // chunk
    groups = heads // key_heads
    acc = initial_state.dtype
    cum = jnp.cumsum(g.reshape(batch, heads, chunks, chunk), axis=-1)
    cum_row = cum.reshape(batch, heads, chunks, 1, chunk)
    cum = cum.reshape(batch, heads, length, 1)
    beta = beta.reshape(batch, heads, length, 1)
    sequences = initial_state.shape[0]

    def qk_map(b, h, c, *_):
        return (b, h // groups, c, 0)

    def token_map(b, h, c, *_):
        return (b, h, c, 0)

    def state_map(b, h, c, sequence, _):
        return (sequence[b * chunks + c], h, 0, 0)

    itemsize = q.dtype.itemsize
    tokens = batch * heads * length
    cost = pl.CostEstimate(
        # k k^T, q k^T, the solve, W S, q S, attn v_new, k^T v_new per chunk
        flops=tokens * (2 * chunk * (2 * key_dim + 2 * value_dim + key_dim))
        + tokens * 6 * key_dim * value_dim,
        transcendentals=tokens * (chunk + 2),
        bytes_accessed=2 * batch * key_heads * length * key_dim * itemsize
        + tokens * value_dim * (v.dtype.itemsize + jnp.dtype(out_dtype).itemsize)
        + tokens * 2 * 4
        + 2 * sequences * heads * key_dim * value_dim * acc.itemsize,
    )
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(batch, heads, chunks),
        in_specs=[
            pl.BlockSpec((None, None, chunk, key_dim), qk_map),
            pl.BlockSpec((None, None, chunk, key_dim), qk_map),
            pl.BlockSpec((None, None, chunk, value_dim), token_map),
            pl.BlockSpec((None, None, chunk, 1), token_map),
            pl.BlockSpec((None, None, None, 1, chunk), lambda b, h, c, *_: (b, h, c, 0, 0)),
            pl.BlockSpec((None, None, chunk, 1), token_map),
            pl.BlockSpec((None, None, key_dim, value_dim), state_map),
        ],
        out_specs=[
            pl.BlockSpec((None, None, chunk, value_dim), token_map),
            pl.BlockSpec((None, None, key_dim, value_dim), state_map),
        ],
        scratch_shapes=[
            pltpu.VMEM((key_dim, value_dim), acc),
            pltpu.VMEM((chunk, chunk), acc),
            pltpu.VMEM((chunk, value_dim + key_dim), acc),
        ],
    )
    return pl.pallas_call(
        _chunk_kernel,
        grid_spec=grid_spec,
        out_shape=(
            jax.ShapeDtypeStruct((batch, heads, length, value_dim), out_dtype),
            jax.ShapeDtypeStruct(initial_state.shape, acc),
        ),
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
        cum.astype(acc),
        cum_row.astype(acc),
        beta.astype(acc),
        initial_state,
    )


def _xla_chunked(q, k, v, g, beta, initial_state, chunk_sequence, chunk_starts, config):
    heads = v.shape[1]
    groups = heads // q.shape[1]
    acc = initial_state.dtype
    q, k = (jnp.repeat(x, groups, axis=1) if groups > 1 else x for x in (q, k))
    p = Plan(g.shape[-1], None, None, chunk_sequence, chunk_starts)
    return xla_chunked.chunked(
        q, k, v.astype(acc), g.astype(acc), beta.astype(acc), initial_state, p, config.chunk
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


def _chunk_fwd(q, k, v, g, beta, initial_state, chunk_sequence, chunk_starts, *static):
    inputs = (q, k, v, g, beta, initial_state, chunk_sequence, chunk_starts)
    return chunk_gated_delta_rule(*inputs, *static), inputs


def _chunk_bwd(config, out_dtype, interpret, residuals, cotangents):
    *floats, chunk_sequence, chunk_starts = residuals
    _, vjp = jax.vjp(lambda *xs: _xla_chunked(*xs, chunk_sequence, chunk_starts, config), *floats)
    d_out, d_final = cotangents
    acc = floats[-1].dtype
    grads = vjp((d_out.astype(acc), d_final.astype(acc)))
    grads = tuple(grad.astype(x.dtype) for grad, x in zip(grads, floats, strict=True))
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
