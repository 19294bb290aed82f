"""Pallas TPU Mamba-2 scan: the chunked form (prefill, training forward) and the decode step.

Chunked: grid (batch, head, chunk); the chunk axis runs in order and carries the f32 ``[P, N]``
state in VMEM. Per chunk: ``(C B^T) * decay`` times ``dt x`` for the chunk's own tokens, the
entering state read through C, and the state update, all matmuls on the MXU. B/C groups are shared
by ``H / G`` heads through the index maps. Packed rows come in as the masks of
``chunked.masks`` plus the sequence index (for the intra-chunk same-sequence mask). Per-token
vectors (dt, the decay sums, the masks) travel as lane-dense rows and become columns in VMEM.

Backward: the forward also writes the state entering every chunk (f32 ``[B, H, chunks, P, N]``);
a second kernel walks the chunks in reverse on the same grid, carrying the gradient of the state
in VMEM, and recomputes each chunk's ``C B^T`` and decay from its inputs. It writes per-head
gradients of x, B, C and of the in-chunk cumulative sums of ``dt A``; XLA sums B and C over the
heads of a group and runs the cumulative sum's gradient (a reversed cumulative sum).

Decode: grid (batch, head block); each step reads and writes the state once (aliased to the
input state, so a donated cache buffer is updated in place). Per-channel vectors (x, dt, z, D,
y) travel lane-dense as ``[heads, P]`` and become ``[heads, P, 1]`` columns in VMEM.
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

from . import chunked

HIGHEST = jax.lax.Precision.HIGHEST


@dataclass(frozen=True)
class ChunkConfig:
    """Tokens per chunk: a multiple of 16 (the bf16 sublane tile; ``tiling.chunk_problem``)."""

    chunk: int = 256


def _dot_t(a, b, contract: int):
    """a^T b (contract=0) or a b^T (contract=1) without materialising the transpose."""
    dims = (((0,), (0,)), ((), ())) if contract == 0 else (((1,), (1,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, precision=HIGHEST, preferred_element_type=a.dtype)


def _column(row_vector, chunk: int):
    """A [1, chunk] row as a [chunk, 1] column (select on the diagonal, sum along the lanes):
    columns live in HBM as rows, since a [.., L, 1] array pads its lane axis 128-fold on TPU."""
    row = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
    return jnp.sum(jnp.where(row == col, row_vector, 0), axis=1, keepdims=True)


def _chunk_kernel(
    x_ref,
    dt_ref,
    cum_ref,
    b_ref,
    c_ref,
    seq_ref,
    reach_ref,
    to_end_ref,
    init_ref,
    y_ref,
    final_ref,
    *rest,
):
    *entering_ref, state_ref = rest
    acc = state_ref.dtype

    @pl.when(pl.program_id(2) == 0)
    def _():
        state_ref[...] = init_ref[...].astype(acc)

    chunk = x_ref.shape[0]
    cum_row, seq_row = cum_ref[...], seq_ref[...]
    dt, cum, seq = (_column(r, chunk) for r in (dt_ref[...], cum_row, seq_row))
    reach, to_end = (_column(r[...], chunk) for r in (reach_ref, to_end_ref))
    xdt = x_ref[...].astype(acc) * dt
    b, c = b_ref[...].astype(acc), c_ref[...].astype(acc)
    row = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
    allowed = (row >= col) & (seq == seq_row)
    scores = _dot_t(c, b, 1) * jnp.exp(jnp.where(allowed, cum - cum_row, -jnp.inf))
    state = state_ref[...]
    if entering_ref:  # saved for the backward
        entering_ref[0][...] = state
    y = jnp.dot(scores, xdt, precision=HIGHEST, preferred_element_type=acc)
    y = y + _dot_t(c, state, 1) * (jnp.exp(cum) * reach)
    y_ref[...] = y.astype(y_ref.dtype)
    last = cum[chunk - 1 :, :]
    weighted = xdt * (jnp.exp(last - cum) * to_end)
    state = state * (jnp.exp(last) * reach[chunk - 1 :, :]) + _dot_t(weighted, b, 0)
    state_ref[...] = state
    final_ref[...] = state.astype(final_ref.dtype)


def _heads_first(t, padded: int):
    """[b, L, h, d] -> [b, h, Lp, d], the tokens padded to ``padded``."""
    return jnp.transpose(chunked.pad_tokens(t, padded), (0, 2, 1, 3))


def _chunk_operands(x, dt, A, B, C, seq, chunk: int, acc):
    """The eight operands both passes read, in their order: x, dt, the in-chunk cumulative sums
    of dt A, B, C, seq and the two masks (x, B, C head-major; the per-token vectors as
    ``[.., chunks, 1, chunk]`` rows); and dt padded (in ``acc``), which the backward reuses."""
    batch, heads = x.shape[0], x.shape[2]
    padded = seq.shape[1]
    chunks = padded // chunk
    reach, to_end = (m.astype(acc) for m in chunked.masks(seq, chunk))
    dt = chunked.pad_tokens(dt.astype(acc), padded)
    cum = jnp.cumsum((dt * A).reshape(batch, chunks, chunk, heads), axis=2)
    cum = jnp.transpose(cum, (0, 3, 1, 2))  # [b, h, c, l]
    row_shape = (batch, chunks, 1, chunk)
    operands = [
        _heads_first(x, padded),
        jnp.transpose(dt.reshape(batch, chunks, 1, chunk, heads), (0, 4, 1, 2, 3)),
        cum.reshape(batch, heads, chunks, 1, chunk),
        _heads_first(B, padded),
        _heads_first(C, padded),
        seq.reshape(row_shape),
        reach.reshape(row_shape),
        to_end.reshape(row_shape),
    ]
    return operands, dt


def _chunk_forward(
    x, dt, A, B, C, initial_state, seq, config: ChunkConfig, interpret: bool, save: bool = False
):
    """Prepared inputs as in ``chunked.chunk_scan``; returns (y without D, final state), and with
    ``save`` the state entering every chunk ``[B, H, chunks, P, N]`` (f32) too."""
    acc = initial_state.dtype
    batch, length, heads, width = x.shape
    groups, state_size = B.shape[2], B.shape[3]
    chunk = config.chunk
    padded = seq.shape[1]
    chunks = padded // chunk
    per_group = heads // groups
    operands, _ = _chunk_operands(x, dt, A, B, C, seq, chunk, acc)

    def token_map(b, h, c):
        return (b, h, c, 0)

    def group_map(b, h, c):
        return (b, h // per_group, c, 0)

    def row_map(b, h, c):
        return (b, h, c, 0, 0)

    def seq_map(b, h, c):
        return (b, c, 0, 0)

    def state_map(b, h, c):
        return (b, h, 0, 0)

    tokens = batch * heads * padded
    cost = pl.CostEstimate(
        # C B^T, scores x, C S, x^T B per chunk
        flops=tokens * 2 * (chunk * state_size + chunk * width + 2 * width * state_size),
        transcendentals=tokens * (chunk + 2),
        bytes_accessed=tokens * width * (x.dtype.itemsize + 4)
        + 2 * batch * groups * padded * state_size * B.dtype.itemsize
        + tokens * 2 * 4
        + (2 + (chunks if save else 0)) * batch * heads * width * state_size * acc.itemsize,
    )
    state_spec = pl.BlockSpec((None, None, width, state_size), state_map)
    out_specs = [pl.BlockSpec((None, None, chunk, width), token_map), state_spec]
    out_shape = [
        jax.ShapeDtypeStruct((batch, heads, padded, width), acc),
        jax.ShapeDtypeStruct(initial_state.shape, acc),
    ]
    if save:
        out_specs.append(
            pl.BlockSpec((None, None, None, width, state_size), lambda b, h, c: (b, h, c, 0, 0))
        )
        out_shape.append(jax.ShapeDtypeStruct((batch, heads, chunks, width, state_size), acc))
    head_row = pl.BlockSpec((None, None, None, 1, chunk), row_map)
    seq_row = pl.BlockSpec((None, None, 1, chunk), seq_map)
    y, final, *entering = pl.pallas_call(
        _chunk_kernel,
        grid=(batch, heads, chunks),
        in_specs=[
            pl.BlockSpec((None, None, chunk, width), token_map),
            head_row,
            head_row,
            pl.BlockSpec((None, None, chunk, state_size), group_map),
            pl.BlockSpec((None, None, chunk, state_size), group_map),
            seq_row,
            seq_row,
            seq_row,
            state_spec,
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        scratch_shapes=[pltpu.VMEM((width, state_size), acc)],
        compiler_params=tiling.compiler_params("parallel", "parallel", "arbitrary"),
        cost_estimate=cost,
        interpret=interpret,
        name="mamba_chunk_scan",
    )(*operands, initial_state)
    return (jnp.transpose(y, (0, 2, 1, 3))[:, :length], final, *entering)


def _row(column, chunk: int):
    """A [chunk, 1] column as a [1, chunk] row (the transpose of ``_column``)."""
    row = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
    return jnp.sum(jnp.where(row == col, column, 0), axis=0, keepdims=True)


def _chunk_backward_kernel(
    x_ref,
    dt_ref,
    cum_ref,
    b_ref,
    c_ref,
    seq_ref,
    reach_ref,
    to_end_ref,
    entering_ref,
    dy_ref,
    dfinal_ref,
    dx_ref,
    db_ref,
    dc_ref,
    dcum_ref,
    ddt_ref,
    dinit_ref,
    dstate_ref,
):
    """One chunk of the backward, chunks walked last to first: the gradient of the state leaving
    the chunk is carried in VMEM, the state entering it was saved by the forward."""
    acc = dstate_ref.dtype

    @pl.when(pl.program_id(2) == 0)
    def _():
        dstate_ref[...] = dfinal_ref[...].astype(acc)

    chunk = x_ref.shape[0]
    cum_row, seq_row = cum_ref[...], seq_ref[...]
    dt, cum, seq = (_column(r, chunk) for r in (dt_ref[...], cum_row, seq_row))
    reach, to_end = (_column(r[...], chunk) for r in (reach_ref, to_end_ref))
    x = x_ref[...].astype(acc)
    xdt = x * dt
    b, c = b_ref[...].astype(acc), c_ref[...].astype(acc)
    row = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
    allowed = (row >= col) & (seq == seq_row)
    decay = jnp.exp(jnp.where(allowed, cum - cum_row, -jnp.inf))
    cb = _dot_t(c, b, 1)
    scores = cb * decay
    entering, leaving = entering_ref[...], dstate_ref[...]  # state in, gradient of state out
    dy = dy_ref[...].astype(acc)
    reads = jnp.exp(cum) * reach  # how the entering state reaches each token
    last = cum[chunk - 1 :, :]
    passes = jnp.exp(last) * reach[chunk - 1 :, :]  # how it passes through the whole chunk
    adds = jnp.exp(last - cum) * to_end  # how each token adds to the leaving state
    dy_reads = dy * reads
    d_cb = _dot_t(dy, xdt, 1) * decay  # gradient of C B^T
    b_leaving = _dot_t(b, leaving, 1)  # [chunk, P]
    dxdt = _dot_t(scores, dy, 0) + adds * b_leaving
    db = _dot_t(d_cb, c, 0) + jnp.dot(xdt * adds, leaving, precision=HIGHEST)
    dc = jnp.dot(d_cb, b, precision=HIGHEST) + jnp.dot(dy_reads, entering, precision=HIGHEST)
    # cum: through the decay (l minus s), the entering state's reach, the tokens' additions and
    # the state passed through (the last token's cum)
    d_log = d_cb * cb
    d_adds = jnp.sum(xdt * b_leaving, axis=1, keepdims=True) * adds
    dcum = jnp.sum(d_log, axis=1, keepdims=True) - _column(
        jnp.sum(d_log, axis=0, keepdims=True), chunk
    )
    dcum = dcum + jnp.sum(dy * _dot_t(c, entering, 1), axis=1, keepdims=True) * reads - d_adds
    d_last = (
        jnp.sum(d_adds, axis=0, keepdims=True) + jnp.sum(leaving * entering, keepdims=True) * passes
    )
    dcum = dcum + jnp.where(row[:, :1] == chunk - 1, d_last, 0.0)
    dstate = leaving * passes + _dot_t(dy_reads, c, 0)
    dstate_ref[...] = dstate
    dinit_ref[...] = dstate.astype(dinit_ref.dtype)
    dx_ref[...] = (dxdt * dt).astype(dx_ref.dtype)
    db_ref[...] = db.astype(db_ref.dtype)
    dc_ref[...] = dc.astype(dc_ref.dtype)
    dcum_ref[...] = _row(dcum, chunk)
    ddt_ref[...] = _row(jnp.sum(dxdt * x, axis=1, keepdims=True), chunk)


def _chunk_backward(x, dt, A, B, C, initial_state, seq, entering, dy, dfinal, config, interpret):
    """Gradients of ``_chunk_forward`` in (x, dt, A, B, C, initial_state): one Pallas pass over
    the chunks in reverse; the per-head B/C gradients are summed over each group's heads, and
    the gradient of the within-chunk cumulative sum of dt A is taken by XLA."""
    acc = initial_state.dtype
    batch, length, heads, width = x.shape
    groups, state_size = B.shape[2], B.shape[3]
    chunk = config.chunk
    padded = seq.shape[1]
    chunks = padded // chunk
    per_group = heads // groups
    operands, dt_padded = _chunk_operands(x, dt, A, B, C, seq, chunk, acc)

    def token_map(b, h, c):
        return (b, h, chunks - 1 - c, 0)

    def group_map(b, h, c):
        return (b, h // per_group, chunks - 1 - c, 0)

    def row_map(b, h, c):
        return (b, h, chunks - 1 - c, 0, 0)

    def seq_map(b, h, c):
        return (b, chunks - 1 - c, 0, 0)

    def state_map(b, h, c):
        return (b, h, 0, 0)

    tokens = batch * heads * padded
    state_spec = pl.BlockSpec((None, None, width, state_size), state_map)
    head_row = pl.BlockSpec((None, None, None, 1, chunk), row_map)
    seq_row = pl.BlockSpec((None, None, 1, chunk), seq_map)
    width_spec = pl.BlockSpec((None, None, chunk, width), token_map)
    state_size_spec = pl.BlockSpec((None, None, chunk, state_size), token_map)
    out_shape = [
        jax.ShapeDtypeStruct((batch, heads, padded, width), acc),
        jax.ShapeDtypeStruct((batch, heads, padded, state_size), acc),
        jax.ShapeDtypeStruct((batch, heads, padded, state_size), acc),
        jax.ShapeDtypeStruct((batch, heads, chunks, 1, chunk), acc),
        jax.ShapeDtypeStruct((batch, heads, chunks, 1, chunk), acc),
        jax.ShapeDtypeStruct(initial_state.shape, acc),
    ]
    inputs = [*operands, entering, _heads_first(dy.astype(acc), padded), dfinal]
    cost = pl.CostEstimate(
        # per chunk: C B^T, dy xdt^T, scores^T dy, dcb^T C, dcb B (chunk x chunk x P or N each);
        # B dS^T, (xdt w) dS, dy S_in, C S_in^T, dy^T C (chunk x P x N each)
        flops=tokens * 2 * (chunk * (2 * state_size + 3 * width) + 5 * width * state_size),
        transcendentals=tokens * (chunk + 3),
        bytes_accessed=sum(a.size * a.dtype.itemsize for a in inputs)
        + sum(math.prod(o.shape) * o.dtype.itemsize for o in out_shape),
    )
    dx, db, dc, dcum, ddt, dinit = pl.pallas_call(
        _chunk_backward_kernel,
        grid=(batch, heads, chunks),
        in_specs=[
            width_spec,
            head_row,
            head_row,
            pl.BlockSpec((None, None, chunk, state_size), group_map),
            pl.BlockSpec((None, None, chunk, state_size), group_map),
            seq_row,
            seq_row,
            seq_row,
            pl.BlockSpec(
                (None, None, None, width, state_size), lambda b, h, c: (b, h, chunks - 1 - c, 0, 0)
            ),
            width_spec,
            state_spec,
        ],
        out_specs=[
            width_spec,
            state_size_spec,
            state_size_spec,
            head_row,
            head_row,
            state_spec,
        ],
        out_shape=out_shape,
        scratch_shapes=[pltpu.VMEM((width, state_size), acc)],
        compiler_params=tiling.compiler_params("parallel", "parallel", "arbitrary"),
        cost_estimate=cost,
        interpret=interpret,
        name="mamba_chunk_scan_backward",
    )(*inputs)

    def tokens_first(t):  # [b, h, Lp, d] -> [b, L, h, d]
        return jnp.transpose(t, (0, 2, 1, 3))[:, :length]

    def per_group_sum(t):
        return t.reshape(batch, groups, per_group, padded, state_size).sum(axis=2)

    # cum is a running sum of dt A within each chunk: its gradient runs backwards
    d_dt_a = jnp.flip(jnp.cumsum(jnp.flip(dcum[:, :, :, 0], -1), -1), -1)
    d_dt_a = jnp.transpose(d_dt_a.reshape(batch, heads, padded), (0, 2, 1))  # [b, Lp, h]
    ddt = jnp.transpose(ddt.reshape(batch, heads, padded), (0, 2, 1)) + d_dt_a * A
    dA = jnp.sum(d_dt_a * dt_padded, axis=(0, 1))
    return (
        tokens_first(dx).astype(x.dtype),
        ddt[:, :length].astype(dt.dtype),
        dA.astype(A.dtype),
        tokens_first(per_group_sum(db)).astype(B.dtype),
        tokens_first(per_group_sum(dc)).astype(C.dtype),
        dinit.astype(initial_state.dtype),
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def chunk_scan(x, dt, A, B, C, initial_state, seq, config: ChunkConfig, interpret: bool):
    """The Pallas forward; the Pallas backward walks the chunks in reverse from the states the
    forward saved."""
    return _chunk_forward(x, dt, A, B, C, initial_state, seq, config, interpret)


def _chunk_fwd(x, dt, A, B, C, initial_state, seq, config, interpret):
    y, final, entering = _chunk_forward(
        x, dt, A, B, C, initial_state, seq, config, interpret, save=True
    )
    return (y, final), (x, dt, A, B, C, initial_state, seq, entering)


def _chunk_bwd(config, interpret, saved, cotangents):
    *inputs, entering = saved
    dy, dfinal = cotangents
    return (*_chunk_backward(*inputs, entering, dy, dfinal, config, interpret), None)


chunk_scan.defvjp(_chunk_fwd, _chunk_bwd)


def _columns(rows):
    """[heads, P] lane-dense rows as [heads, P, 1] columns (select on the diagonal, sum along the
    lanes): the per-channel vectors travel lane-dense, a [.., P, 1] array would pad its lanes."""
    heads, width = rows.shape
    shape = (heads, width, width)
    eye = jax.lax.broadcasted_iota(jnp.int32, shape, 1) == jax.lax.broadcasted_iota(
        jnp.int32, shape, 2
    )
    return jnp.sum(jnp.where(eye, rows[:, None, :], 0), axis=2, keepdims=True)


def _rows(columns):
    """[heads, P, 1] columns back to [heads, P] rows (the transpose of ``_columns``)."""
    heads, width, _ = columns.shape
    shape = (heads, width, width)
    eye = jax.lax.broadcasted_iota(jnp.int32, shape, 1) == jax.lax.broadcasted_iota(
        jnp.int32, shape, 2
    )
    return jnp.sum(jnp.where(eye, columns, 0), axis=1)


def _decode_kernel(*refs, has_z: bool):
    if has_z:
        x_ref, dt_ref, a_ref, b_ref, c_ref, d_ref, z_ref, state_ref, y_ref, new_ref = refs
    else:
        x_ref, dt_ref, a_ref, b_ref, c_ref, d_ref, state_ref, y_ref, new_ref = refs
    acc = dt_ref.dtype  # the compute dtype (dt arrives prepared in it)
    x, dt = _columns(x_ref[...].astype(acc)), _columns(dt_ref[...])
    state = state_ref[...].astype(acc) * jnp.exp(dt * a_ref[...])
    state = state + (dt * b_ref[...].astype(acc)) * x
    new_ref[...] = state.astype(new_ref.dtype)
    y = jnp.sum(state * c_ref[...].astype(acc), axis=-1, keepdims=True)
    y = _rows(y) + x_ref[...].astype(acc) * d_ref[...]
    if has_z:
        z = z_ref[...].astype(acc)
        y = y * (z * jax.nn.sigmoid(z))
    y_ref[...] = y.astype(y_ref.dtype)


def head_block(heads: int) -> int:
    """Heads per decode step: 8 (a sublane tile of the [heads, P] vectors) when it divides."""
    return 8 if heads % 8 == 0 else heads


def state_update(state, x, dt, A, B, C, D, z, interpret: bool):
    """Decode on prepared inputs: state ``[B, H, P, N]``, x/dt/z ``[B, H, P]`` (z may be None),
    A ``[H, P, N]``, B/C ``[B, H, N]`` (already per head), D ``[H, P]``. Returns (y ``[B, H, P]``
    in x's dtype, the new state, aliased to ``state``)."""
    batch, heads, width, state_size = state.shape
    block = head_block(heads)
    channels = pl.BlockSpec((None, block, width), lambda b, h: (b, h, 0))
    row = pl.BlockSpec((None, block, 1, state_size), lambda b, h: (b, h, 0, 0))
    full = pl.BlockSpec((None, block, width, state_size), lambda b, h: (b, h, 0, 0))
    inputs = [x, dt, A, B[:, :, None, :], C[:, :, None, :], D]
    in_specs = [
        channels,
        channels,
        pl.BlockSpec((block, width, state_size), lambda b, h: (h, 0, 0)),
        row,
        row,
        pl.BlockSpec((block, width), lambda b, h: (h, 0)),
    ]
    if z is not None:
        inputs.append(z)
        in_specs.append(channels)
    inputs.append(state)
    in_specs.append(full)
    entries = batch * heads * width * state_size
    cost = pl.CostEstimate(
        flops=6 * entries,
        transcendentals=entries,
        bytes_accessed=2 * entries * state.dtype.itemsize + heads * width * state_size * 4,
    )
    y, new_state = pl.pallas_call(
        functools.partial(_decode_kernel, has_z=z is not None),
        grid=(batch, heads // block),
        in_specs=in_specs,
        out_specs=[channels, full],
        out_shape=(
            jax.ShapeDtypeStruct((batch, heads, width), x.dtype),
            jax.ShapeDtypeStruct(state.shape, state.dtype),
        ),
        input_output_aliases={len(inputs) - 1: 1},
        compiler_params=tiling.compiler_params("parallel", "parallel"),
        cost_estimate=cost,
        interpret=interpret,
        name="selective_state_update",
    )(*inputs)
    return y, new_state
