"""Public JAX API: ``mamba_chunk_scan_combined`` (prefill, training; packed rows via ``seq_idx``)
and ``selective_state_update`` (decode), each with an implementation table (pallas, xla) and input
checks. Shapes and numerics are Transformers' torch fallbacks' (see ``reference``)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from kernel_hub.kernel_api import (
    FLOATS_AND_F64,
    Einsum,
    check_dtype,
    check_int32_values,
    check_rank,
    float64_problem,
    jax_platform,
    op,
    pallas_and_xla,
    require,
    tiling,
)

from . import chunked, pallas_tpu, reference

CHUNK_OP = "mamba_chunk_scan_combined"
DECODE_OP = "selective_state_update"
INTEGERS = ("int32", "int64")


def _check_shape(op, name, x, allowed: dict[str, tuple[int, ...]]) -> None:
    if x is None:
        return
    check_dtype(op, name, x, FLOATS_AND_F64)
    forms = " or ".join(f"{label} {list(shape)}" for label, shape in allowed.items())
    require(
        tuple(x.shape) in allowed.values(),
        f"{op}: {name} has shape {tuple(x.shape)}; it must be {forms}",
    )


def check_chunk_inputs(x, dt, A, B, C, D=None, dt_bias=None, initial_states=None, seq_idx=None):
    """Shape and dtype rules shared by the JAX function and the torch op."""
    op = CHUNK_OP
    for name, t, rank in (("x", x, 4), ("dt", dt, 3), ("A", A, 1), ("B", B, 4), ("C", C, 4)):
        check_rank(op, name, t, rank)
        check_dtype(op, name, t, FLOATS_AND_F64)
    batch, length, heads, width = x.shape
    groups, state_size = B.shape[2], B.shape[3]
    require(
        tuple(B.shape[:2]) == (batch, length) and heads % groups == 0,
        f"{op}: B has shape {tuple(B.shape)}; it must be [{batch}, {length}, G, N] with the "
        f"{heads} heads a multiple of G",
    )
    require(
        tuple(C.shape) == tuple(B.shape),
        f"{op}: C has shape {tuple(C.shape)} but B has {tuple(B.shape)}; they must match",
    )
    _check_shape(op, "dt", dt, {"[B, L, H]": (batch, length, heads)})
    _check_shape(op, "A", A, {"[H]": (heads,)})
    _check_shape(op, "D", D, {"[H]": (heads,)})
    _check_shape(op, "dt_bias", dt_bias, {"[H]": (heads,)})
    _check_shape(
        op, "initial_states", initial_states, {"[B, H, P, N]": (batch, heads, width, state_size)}
    )
    if seq_idx is not None:
        check_dtype(op, "seq_idx", seq_idx, INTEGERS)
        require(
            tuple(seq_idx.shape) == (batch, length),
            f"{op}: seq_idx has shape {tuple(seq_idx.shape)}; it must be [B, L] = "
            f"{[batch, length]} (non-decreasing sequence numbers per row)",
        )


def check_seq_idx_values(seq_idx=None) -> None:
    """On every call where they can be read (``host_values``): sequence numbers that fit int32
    and never decrease along a row (the kernels test equality: a number that came back would
    join an earlier sequence)."""
    if seq_idx is None:
        return
    op = CHUNK_OP
    values = check_int32_values(op, "seq_idx", seq_idx)
    if values is not None and (values[:, 1:] < values[:, :-1]).any():
        row, at = (int(i) for i in np.argwhere(values[:, 1:] < values[:, :-1])[0])
        require(
            False,
            f"{op}: seq_idx decreases in row {row} ({int(values[row, at])} then "
            f"{int(values[row, at + 1])} at {at + 1}); a row's sequence numbers must never "
            "decrease (a sequence is one run of equal numbers)",
        )


def check_decode_inputs(state, x, dt, A, B, C, D=None, z=None, dt_bias=None):
    """Shape and dtype rules of the decode step (per-channel dt, A, D, dt_bias, as Transformers'
    mixers pass them: expanded views of per-head values)."""
    op = DECODE_OP
    for name, t, rank in (("state", state, 4), ("x", x, 3), ("B", B, 3), ("C", C, 3)):
        check_rank(op, name, t, rank)
        check_dtype(op, name, t, FLOATS_AND_F64)
    batch, heads, width, state_size = state.shape
    require(
        tuple(x.shape) == (batch, heads, width),
        f"{op}: x has shape {tuple(x.shape)}; it must be [B, H, P] = {[batch, heads, width]}",
    )
    groups = B.shape[1]
    require(
        tuple(B.shape) == (batch, groups, state_size) and heads % groups == 0,
        f"{op}: B has shape {tuple(B.shape)}; it must be [{batch}, G, {state_size}] with the "
        f"{heads} heads a multiple of G",
    )
    require(
        tuple(C.shape) == tuple(B.shape),
        f"{op}: C has shape {tuple(C.shape)} but B has {tuple(B.shape)}; they must match",
    )
    _check_shape(op, "dt", dt, {"[B, H, P]": (batch, heads, width)})
    _check_shape(op, "A", A, {"[H, P, N]": (heads, width, state_size)})
    _check_shape(op, "D", D, {"[H, P]": (heads, width)})
    _check_shape(op, "dt_bias", dt_bias, {"[H, P]": (heads, width)})
    _check_shape(op, "z", z, {"[B, H, P]": (batch, heads, width)})


def _check_limit(dt_min: float, dt_max: float) -> None:
    require(
        not math.isnan(dt_min) and not math.isnan(dt_max) and dt_min <= dt_max,
        f"{CHUNK_OP}: dt_limit ({dt_min}, {dt_max}) must be a (low, high) pair with low <= high",
    )


def _padded_length(length: int, chunk: int) -> int:
    return max(1, math.ceil(length / chunk)) * chunk


def _prepared(x, dt, A, dt_bias, initial_states, seq_idx, chunk, dt_softplus, limit):
    acc = reference.compute_dtype(x.dtype)
    batch, length = x.shape[:2]
    dt = reference.prepare_dt(dt, dt_bias, dt_softplus, limit).astype(acc)
    seq = chunked.padded_sequences(seq_idx, batch, length, _padded_length(length, chunk))
    return acc, dt, A.astype(acc), seq


def _with_skip(y, x, D, acc):
    if D is None:
        return y
    return y + x.astype(acc) * D.astype(acc)[:, None]


def _initial(initial_states, x, B, acc):
    batch, _, heads, width = x.shape
    if initial_states is None:
        return jnp.zeros((batch, heads, width, B.shape[-1]), acc)
    return initial_states.astype(acc)


def _chunk_xla(x, dt, A, B, C, D, dt_bias, initial_states, seq_idx, *, chunk_size, **options):
    acc, dt_p, A_p, seq = _prepared(
        x, dt, A, dt_bias, initial_states, seq_idx, chunk_size, **options
    )
    init = _initial(initial_states, x, B, acc)
    y, final = chunked.chunk_scan(x.astype(acc), dt_p, A_p, B, C, init, seq, chunk_size)
    return _with_skip(y, x, D, acc), final


def _chunk_pallas(x, dt, A, B, C, D, dt_bias, initial_states, seq_idx, *, chunk_size, **options):
    acc, dt_p, A_p, seq = _prepared(
        x, dt, A, dt_bias, initial_states, seq_idx, chunk_size, **options
    )
    init = _initial(initial_states, x, B, acc)
    y, final = pallas_tpu.chunk_scan(
        x,
        dt_p,
        A_p,
        B,
        C,
        init,
        seq,
        pallas_tpu.ChunkConfig(chunk_size),
        jax_platform() == "cpu",
    )
    return _with_skip(y, x, D, acc), final


def _chunk_pallas_problem(x, *args, chunk_size, **kwargs):
    return float64_problem(x) or tiling.chunk_problem(chunk_size)


CHUNK_TABLE = pallas_and_xla(CHUNK_OP, _chunk_pallas, _chunk_xla, _chunk_pallas_problem)

# Sharding: batch and heads split (B/C groups together with their heads, so each shard keeps
# whole groups); the sequence, head dim and state dim stay whole (the recurrence runs along the
# sequence).
_X = "batch length heads head_dim"
_BC = "batch length groups state"
_STATE = "batch heads head_dim state"
_SHARDING = {
    "whole": ("length", "head_dim", "state"),
    "together": (("heads", "groups"),),
    "handled_by": {"length": "nothing yet: the recurrence needs the whole sequence per shard"},
}


@op(
    check=check_chunk_inputs,
    check_values=check_seq_idx_values,
    differentiable=("x", "dt", "A", "B", "C", "D", "dt_bias", "initial_states"),
    sharding=Einsum(
        f"{_X}, batch length heads, heads, {_BC}, {_BC}, heads, heads, {_STATE}, "
        f"batch length -> {_X}, {_STATE}",
        **_SHARDING,
    ),
)
def mamba_chunk_scan_combined(
    x: jax.Array,
    dt: jax.Array,
    A: jax.Array,
    B: jax.Array,
    C: jax.Array,
    D: jax.Array | None = None,
    dt_bias: jax.Array | None = None,
    initial_states: jax.Array | None = None,
    seq_idx: jax.Array | None = None,
    *,
    chunk_size: int = 256,
    dt_softplus: bool = False,
    dt_min: float = 0.0,
    dt_max: float | None = None,
    implementation: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The Mamba-2 scan over whole sequences, chunk by chunk.

    x ``[B, L, H, P]``, dt ``[B, L, H]``, A ``[H]`` (negative), B/C ``[B, L, G, N]``, D ``[H]``
    (skip on the raw x), dt_bias ``[H]``, initial_states ``[B, H, P, N]`` (zeros
    when None), seq_idx ``[B, L]`` (non-decreasing per row: the state restarts from zero where it
    changes; the initial state belongs to the row's first sequence). dt is biased, passed through
    softplus when ``dt_softplus``, then clamped to ``[dt_min, dt_max]`` (no upper bound when
    ``dt_max`` is None). Returns (y ``[B, L, H, P]``
    and the final states ``[B, H, P, N]``, both float32, or float64 for float64 x), as
    Transformers' fallback does; ``chunk_size`` only changes rounding (and the Pallas block).
    """
    require(
        isinstance(chunk_size, int) and chunk_size > 0,
        f"{CHUNK_OP}: chunk_size={chunk_size!r}; it must be a positive int",
    )
    dt_max = math.inf if dt_max is None else float(dt_max)
    _check_limit(float(dt_min), dt_max)
    return CHUNK_TABLE(
        x,
        dt,
        A,
        B,
        C,
        D,
        dt_bias,
        initial_states,
        seq_idx,
        chunk_size=chunk_size,
        dt_softplus=dt_softplus,
        limit=(float(dt_min), dt_max),
        implementation=implementation,
    )


def _decode_prepared(x, dt, D, dt_bias, dt_softplus):
    """Prepared dt and D (zeros when None) in the compute dtype."""
    acc = reference.compute_dtype(x.dtype)
    dt = reference.prepare_dt(dt, dt_bias, dt_softplus).astype(acc)
    return dt, jnp.zeros(x.shape[1:], acc) if D is None else D.astype(acc)


def _decode_xla(state, x, dt, A, B, C, D, z, dt_bias, *, dt_softplus):
    dt, D = _decode_prepared(x, dt, D, dt_bias, dt_softplus)
    y, new_state = reference.state_update(state, x, dt, A, B, C, D, z)
    return y.astype(x.dtype), new_state.astype(state.dtype)


def _decode_pallas(state, x, dt, A, B, C, D, z, dt_bias, *, dt_softplus):
    dt, D = _decode_prepared(x, dt, D, dt_bias, dt_softplus)
    heads = x.shape[1]
    B, C = (reference.repeat_groups(t, heads, 1) for t in (B, C))
    A = A.astype(dt.dtype)
    return pallas_tpu.state_update(state, x, dt, A, B, C, D, z, jax_platform() == "cpu")


def _decode_pallas_problem(state, x, *args, **kwargs):
    return float64_problem(state, x)


DECODE_TABLE = pallas_and_xla(DECODE_OP, _decode_pallas, _decode_xla, _decode_pallas_problem)


_TOKEN = "batch heads head_dim"
_GROUP = "batch groups state"


# The decode step has no backward (decode is inference). It returns the new state; callers
# holding a cache tensor copy it over (``layers`` does, as Transformers' fallback does in place).
@op(
    check=check_decode_inputs,
    sharding=Einsum(
        f"{_STATE}, {_TOKEN}, {_TOKEN}, heads head_dim state, {_GROUP}, {_GROUP}, heads head_dim, "
        f"{_TOKEN}, heads head_dim -> {_TOKEN}, {_STATE}",
        **{**_SHARDING, "whole": ("head_dim", "state")},
    ),
)
def selective_state_update(
    state: jax.Array,
    x: jax.Array,
    dt: jax.Array,
    A: jax.Array,
    B: jax.Array,
    C: jax.Array,
    D: jax.Array | None = None,
    z: jax.Array | None = None,
    dt_bias: jax.Array | None = None,
    *,
    dt_softplus: bool = False,
    implementation: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """One decode step of the Mamba-2 scan.

    state ``[B, H, P, N]``, x and dt ``[B, H, P]``, A ``[H, P, N]``, B/C ``[B, G, N]``, D and
    dt_bias ``[H, P]`` (per channel, as Transformers' mixers pass them), z ``[B, H, P]`` (the
    output is gated by ``silu(z)``). dt is biased and passed through softplus but, as in
    Transformers, never clamped. Returns (y ``[B, H, P]`` in x's dtype, the new state in state's
    dtype); the Pallas kernel writes the new state over ``state`` when the caller donates it.
    """
    return DECODE_TABLE(
        state, x, dt, A, B, C, D, z, dt_bias, dt_softplus=dt_softplus, implementation=implementation
    )
