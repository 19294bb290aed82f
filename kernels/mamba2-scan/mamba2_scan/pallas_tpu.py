"""Pallas TPU Mamba-2 scan: the chunked form (prefill, training forward) and the decode step.

Chunked: grid (batch, head, chunk); the chunk axis runs in order and carries the f32 ``[P, N]``
state in VMEM. Per chunk: ``(C B^T) * decay`` times ``dt x`` for the chunk's own tokens, the
entering state read through C, and the state update, all matmuls on the MXU. B/C groups are shared
by ``H / G`` heads through the index maps. Packed rows come in as the masks of
``chunked.masks`` plus the sequence index (for the intra-chunk same-sequence mask). Per-token
vectors (dt, the decay sums, the masks) travel as lane-dense rows and become columns in VMEM.

The backward of the chunked form is ``jax.vjp`` of the XLA chunked form (``chunked.py``) on the
same prepared inputs: a Pallas backward is not written yet.

Decode: grid (batch, head block); each step reads and writes the state once (aliased to the
input state, so a donated cache buffer is updated in place). Per-channel vectors (x, dt, z, D,
y) travel lane-dense as ``[heads, P]`` and become ``[heads, P, 1]`` columns in VMEM.
"""

from __future__ import annotations

import functools
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
    state_ref,
):
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
    y = jnp.dot(scores, xdt, precision=HIGHEST, preferred_element_type=acc)
    y = y + _dot_t(c, state, 1) * (jnp.exp(cum) * reach)
    y_ref[...] = y.astype(y_ref.dtype)
    last = cum[chunk - 1 :, :]
    weighted = xdt * (jnp.exp(last - cum) * to_end)
    state = state * (jnp.exp(last) * reach[chunk - 1 :, :]) + _dot_t(weighted, b, 0)
    state_ref[...] = state
    final_ref[...] = state.astype(final_ref.dtype)


def _chunk_forward(x, dt, A, B, C, initial_state, seq, config: ChunkConfig, interpret: bool):
    """Prepared inputs as in ``chunked.chunk_scan``; returns (y without D, final state)."""
    acc = initial_state.dtype
    batch, length, heads, width = x.shape
    groups, state_size = B.shape[2], B.shape[3]
    chunk = config.chunk
    padded = seq.shape[1]
    chunks = padded // chunk
    per_group = heads // groups
    reach, to_end = (m.astype(acc) for m in chunked.masks(seq, chunk))

    def heads_first(t):  # [b, L, h, d] -> [b, h, Lp, d]
        return jnp.transpose(chunked.pad_tokens(t, padded), (0, 2, 1, 3))

    dt = chunked.pad_tokens(dt.astype(acc), padded)
    cum = jnp.cumsum((dt * A).reshape(batch, chunks, chunk, heads), axis=2)
    cum = jnp.transpose(cum, (0, 3, 1, 2))  # [b, h, c, l]
    row_shape = (batch, chunks, 1, chunk)

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
        + 2 * batch * heads * width * state_size * acc.itemsize,
    )
    head_row = pl.BlockSpec((None, None, None, 1, chunk), row_map)
    seq_row = pl.BlockSpec((None, None, 1, chunk), seq_map)
    y, final = pl.pallas_call(
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
            pl.BlockSpec((None, None, width, state_size), state_map),
        ],
        out_specs=[
            pl.BlockSpec((None, None, chunk, width), token_map),
            pl.BlockSpec((None, None, width, state_size), state_map),
        ],
        out_shape=(
            jax.ShapeDtypeStruct((batch, heads, padded, width), acc),
            jax.ShapeDtypeStruct(initial_state.shape, acc),
        ),
        scratch_shapes=[pltpu.VMEM((width, state_size), acc)],
        compiler_params=tiling.compiler_params("parallel", "parallel", "arbitrary"),
        cost_estimate=cost,
        interpret=interpret,
        name="mamba_chunk_scan",
    )(
        heads_first(x),
        jnp.transpose(dt.reshape(batch, chunks, 1, chunk, heads), (0, 4, 1, 2, 3)),
        cum.reshape(batch, heads, chunks, 1, chunk),
        heads_first(B),
        heads_first(C),
        seq.reshape(row_shape),
        reach.reshape(row_shape),
        to_end.reshape(row_shape),
        initial_state,
    )
    return jnp.transpose(y, (0, 2, 1, 3))[:, :length], final


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def chunk_scan(x, dt, A, B, C, initial_state, seq, config: ChunkConfig, interpret: bool):
    """The Pallas forward; gradients are the XLA chunked form's (``chunked.chunk_scan``)."""
    return _chunk_forward(x, dt, A, B, C, initial_state, seq, config, interpret)


def _chunk_fwd(x, dt, A, B, C, initial_state, seq, config, interpret):
    out = _chunk_forward(x, dt, A, B, C, initial_state, seq, config, interpret)
    return out, (x, dt, A, B, C, initial_state, seq)


def _chunk_bwd(config, interpret, saved, cotangents):
    x, dt, A, B, C, initial_state, seq = saved

    def xla(x, dt, A, B, C, initial_state):
        return chunked.chunk_scan(x, dt, A, B, C, initial_state, seq, config.chunk)

    _, vjp = jax.vjp(xla, x, dt, A, B, C, initial_state)
    return (*vjp(cotangents), None)


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
