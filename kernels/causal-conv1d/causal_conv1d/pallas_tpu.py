"""Pallas TPU depthwise causal convolution.

Full sequence: grid (batch, channel block, token block). A tap that reads ``s`` tokens back is the
token block rolled down by ``s`` rows (``pltpu.roll``, no unaligned slicing); its first ``s`` rows
come from an 8-row halo holding the inputs just before the block (the previous block's tail, or
the initial state for the first block), gathered by XLA beforehand so every grid step is
independent ("parallel" on every axis). Packed sequences pass each token's position in its
sequence: a tap reaching before the sequence start contributes zero.

Backward: the same grid, one pass over x and dy. Each block recomputes its pre-activation z and
that of the 8 tokens after it (their taps reach back into the block; their x and dy rows are
gathered like the halo), forms dz, and writes dx (dz rolled up by each tap's reach, the last rows
from the following tokens' dz), the block's per-tap sums of dz x window (dweight) and of dz
(dbias) as f32 partials that XLA sums over blocks, and, with an initial state, the gradient of
the halo rows (only the first block's is kept: it is the state's).

Decode update: grid (batch, channel block); the conv state rows and the new tokens are read row by
row, the outputs are the taps' sums, and the state (aliased to the input state) is rewritten with
the last rows.
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

from . import reference

HALO = 8  # rows of history per token block: taps reach at most 7 tokens back
MAX_WIDTH = HALO + 1
MAX_DECODE_TOKENS = 16


@dataclass(frozen=True)
class BlockConfig:
    """Tokens and channels per grid step: block_tokens a multiple of 16, block_channels a
    multiple of 128 or all channels."""

    block_tokens: int = 256
    block_channels: int = 512


def config_for(length: int, channels: int, config: BlockConfig | None) -> BlockConfig:
    config = config or BlockConfig()
    tokens = min(config.block_tokens, -(-length // 16) * 16)
    lanes = config.block_channels if channels % 128 == 0 else channels
    return BlockConfig(tokens, min(lanes, channels))


def config_problem(width: int, channels: int, config: BlockConfig | None) -> str | None:
    if width > MAX_WIDTH:
        return f"kernel width {width}; the Pallas kernel takes at most {MAX_WIDTH} taps"
    if config is None:
        return None
    if config.block_tokens <= 0 or config.block_tokens % 16:
        return f"block_tokens={config.block_tokens} must be a positive multiple of 16"
    if config.block_channels != channels and config.block_channels % 128:
        return f"block_channels={config.block_channels} must be a multiple of 128 or {channels}"
    return None


def _shifted(current, halo, shift: int):
    """Rows of ``current`` moved ``shift`` down, the first ``shift`` rows from the halo's end."""
    if shift == 0:
        return current
    rolled = pltpu.roll(current, shift, 0)
    top = jnp.where(
        jax.lax.broadcasted_iota(jnp.int32, halo.shape, 0) < shift,
        pltpu.roll(halo, shift, 0),
        rolled[:HALO],
    )
    if current.shape[0] == HALO:  # Mosaic has no empty vectors
        return top
    return jnp.concatenate([top, rolled[HALO:]], axis=0)


def _conv_kernel(*refs, width: int, activation, packed: bool, has_bias: bool):
    x_ref, halo_ref, w_ref, *rest = refs
    bias_ref = rest.pop(0) if has_bias else None
    position_ref = rest.pop(0) if packed else None
    (y_ref,) = rest
    acc = w_ref.dtype if w_ref.dtype == jnp.float64 else jnp.float32
    current = x_ref[...].astype(w_ref.dtype).astype(acc)
    halo = halo_ref[...].astype(w_ref.dtype).astype(acc)
    w = w_ref[...].astype(acc)
    y = jnp.zeros(current.shape, acc) if bias_ref is None else bias_ref[...].astype(acc)
    for tap in range(width):
        shift = width - 1 - tap
        window = _shifted(current, halo, shift)
        if packed and shift:
            window = jnp.where(position_ref[...] >= shift, window, 0.0)
        y = y + window * w[tap : tap + 1, :]
    y_ref[...] = reference.activate(y, activation).astype(y_ref.dtype)


def _halo(x, initial_state, block: int):
    """[B, blocks, 8, D]: the 8 inputs before each token block (initial state or zeros first)."""
    batch, length, channels = x.shape
    blocks = -(-length // block)
    history = jnp.zeros((batch, HALO, channels), x.dtype)
    if initial_state is not None:
        kept = initial_state.shape[1]
        history = history.at[:, HALO - kept :].set(initial_state.astype(x.dtype))
    index = (jnp.arange(blocks) * block)[:, None] - HALO + jnp.arange(HALO)[None, :]
    from_x = jnp.take(x, jnp.maximum(index, 0).reshape(-1), axis=1).reshape(
        batch, blocks, HALO, channels
    )
    from_history = jnp.take(history, jnp.clip(index + HALO, 0, HALO - 1).reshape(-1), axis=1)
    from_history = from_history.reshape(batch, blocks, HALO, channels)
    return jnp.where((index >= 0)[None, :, :, None], from_x, from_history)


def _forward(x, weight, bias, initial_state, positions, activation, config, interpret):
    length = x.shape[1]
    if length < 16:  # a token block holds at least 16 rows (the halo is replaced within it)
        x = jnp.pad(x, ((0, 0), (0, 16 - length), (0, 0)))
        positions = None if positions is None else jnp.pad(positions, ((0, 0), (0, 16 - length)))
        y = _forward(x, weight, bias, initial_state, positions, activation, config, interpret)
        return y[:, :length]
    batch, length, channels = x.shape
    width = weight.shape[1]
    bt, bd = config.block_tokens, config.block_channels
    grid = (batch, pl.cdiv(channels, bd), pl.cdiv(length, bt))
    token_spec = pl.BlockSpec((None, bt, bd), lambda b, d, t: (b, t, d))
    inputs = [x, _halo(x, initial_state, bt), weight.T]
    specs = [
        token_spec,
        pl.BlockSpec((None, None, HALO, bd), lambda b, d, t: (b, t, 0, d)),
        pl.BlockSpec((width, bd), lambda b, d, t: (0, d)),
    ]
    if bias is not None:
        inputs.append(bias.reshape(1, channels))
        specs.append(pl.BlockSpec((1, bd), lambda b, d, t: (0, d)))
    if positions is not None:
        inputs.append(positions[..., None])
        specs.append(pl.BlockSpec((None, bt, 1), lambda b, d, t: (b, t, 0)))
    elements = batch * length * channels
    cost = pl.CostEstimate(
        flops=elements * (2 * width + (4 if activation else 0)),
        transcendentals=elements if activation else 0,
        bytes_accessed=2 * elements * x.dtype.itemsize + width * channels * weight.dtype.itemsize,
    )
    kernel = functools.partial(
        _conv_kernel,
        width=width,
        activation=activation,
        packed=positions is not None,
        has_bias=bias is not None,
    )
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=specs,
        out_specs=token_spec,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        compiler_params=tiling.compiler_params("parallel", "parallel", "parallel"),
        cost_estimate=cost,
        interpret=interpret,
        name="causal_conv1d",
    )(*inputs)


def _shifted_up(current, following, shift: int):
    """Rows of ``current`` moved ``shift`` up, the last ``shift`` rows from ``following``'s start
    (the 8 rows after the block)."""
    if shift == 0:
        return current
    rolled = pltpu.roll(current, current.shape[0] - shift, 0)
    bottom = jnp.where(
        jax.lax.broadcasted_iota(jnp.int32, following.shape, 0) >= HALO - shift,
        _roll8(following, HALO - shift),
        rolled[-HALO:],
    )
    return jnp.concatenate([rolled[:-HALO], bottom], axis=0)


def _roll8(rows, shift: int):
    """An 8-row tile rolled down by ``shift`` (0 <= shift <= 8)."""
    return rows if shift % HALO == 0 else pltpu.roll(rows, shift, 0)


def _activation_grad(z, dy, activation):
    """dL/dz for y = activate(z)."""
    if activation not in ("silu", "swish"):
        return dy
    s = jax.nn.sigmoid(z)
    return dy * s * (1 + z * (1 - s))


def _conv_bwd_kernel(*refs, width, activation, packed, has_bias, has_state, length):
    x_ref, halo_ref, x_next_ref, dy_ref, dy_next_ref, w_ref, *rest = refs
    bias_ref = rest.pop(0) if has_bias else None
    position_ref, position_next_ref = (rest.pop(0), rest.pop(0)) if packed else (None, None)
    dx_ref, dw_ref, *rest = rest
    db_ref = rest.pop(0) if has_bias else None
    (dhalo_ref,) = rest if has_state else (None,)
    acc = w_ref.dtype if w_ref.dtype == jnp.float64 else jnp.float32
    rows = x_ref.shape[0]
    start = pl.program_id(2) * rows
    valid = start + jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0) < length

    # rows past the sequence end (a ragged last block) are masked: their contents are undefined
    current = jnp.where(valid, x_ref[...].astype(w_ref.dtype).astype(acc), 0.0)
    halo = halo_ref[...].astype(w_ref.dtype).astype(acc)
    following = x_next_ref[...].astype(w_ref.dtype).astype(acc)
    dy = jnp.where(valid, dy_ref[...].astype(acc), 0.0)
    dy_next = dy_next_ref[...].astype(acc)
    w = w_ref[...].astype(acc)
    z = jnp.zeros(current.shape, acc) if bias_ref is None else bias_ref[...].astype(acc)
    z_next = jnp.zeros(following.shape, acc) if bias_ref is None else bias_ref[...].astype(acc)
    windows = []
    for tap in range(width):
        shift = width - 1 - tap
        window = _shifted(current, halo, shift)
        window_next = _shifted(following, current[-HALO:], shift)
        if packed and shift:
            window = jnp.where(position_ref[...] >= shift, window, 0.0)
            window_next = jnp.where(position_next_ref[...] >= shift, window_next, 0.0)
        windows.append(window)
        z = z + window * w[tap : tap + 1, :]
        z_next = z_next + window_next * w[tap : tap + 1, :]
    dz = _activation_grad(z, dy, activation)
    dz_next = _activation_grad(z_next, dy_next, activation)
    dx = jnp.zeros(current.shape, acc)
    dhalo = jnp.zeros(halo.shape, acc)
    taps = []
    for tap in range(width):
        shift = width - 1 - tap
        taps.append(jnp.sum(dz * windows[tap], axis=0, keepdims=True))
        own, own_next = dz, dz_next
        if packed and shift:  # a tap reaching before the target token's sequence reads nothing
            own = jnp.where(position_ref[...] >= shift, own, 0.0)
            own_next = jnp.where(position_next_ref[...] >= shift, own_next, 0.0)
        dx = dx + _shifted_up(own, own_next, shift) * w[tap : tap + 1, :]
        if has_state and shift:
            top = jnp.where(
                jax.lax.broadcasted_iota(jnp.int32, halo.shape, 0) >= HALO - shift,
                _roll8(own[:HALO], HALO - shift),
                0.0,
            )
            dhalo = dhalo + top * w[tap : tap + 1, :]
    dx_ref[...] = dx.astype(w_ref.dtype).astype(dx_ref.dtype)
    dw_ref[...] = jnp.concatenate(taps, axis=0).astype(dw_ref.dtype)
    if db_ref is not None:
        db_ref[...] = jnp.sum(dz, axis=0, keepdims=True).astype(db_ref.dtype)
    if dhalo_ref is not None:
        dhalo_ref[...] = dhalo.astype(dhalo_ref.dtype)


def _following(a, block: int):
    """[B, blocks, 8, ...]: the 8 rows after each token block of ``a`` [B, T, ...] (zeros past
    the end)."""
    batch, length = a.shape[:2]
    blocks = -(-length // block)
    index = ((jnp.arange(blocks) + 1) * block)[:, None] + jnp.arange(HALO)[None, :]
    rows = jnp.take(a, jnp.minimum(index, length - 1).reshape(-1), axis=1)
    rows = rows.reshape(batch, blocks, HALO, *a.shape[2:])
    inside = (index < length).reshape(1, blocks, HALO, *([1] * (a.ndim - 2)))
    return jnp.where(inside, rows, jnp.zeros((), a.dtype))


def _backward(x, weight, bias, initial_state, positions, grad, activation, config, interpret):
    """(dx, dweight, dbias, dinitial_state) of ``_forward``: one pass over x and dy per token
    block, recomputing the block's pre-activation (and that of the 8 tokens after it, whose
    taps reach back into the block)."""
    length = x.shape[1]
    if length < 16:
        pad = ((0, 0), (0, 16 - length), (0, 0))
        x, grad = jnp.pad(x, pad), jnp.pad(grad, pad)
        positions = None if positions is None else jnp.pad(positions, pad[:2])
        dx, *rest = _backward(
            x, weight, bias, initial_state, positions, grad, activation, config, interpret
        )
        return (dx[:, :length], *rest)
    batch, length, channels = x.shape
    width = weight.shape[1]
    bt, bd = config.block_tokens, config.block_channels
    blocks = pl.cdiv(length, bt)
    acc = reference.compute_dtype(weight.dtype)
    token_spec = pl.BlockSpec((None, bt, bd), lambda b, d, t: (b, t, d))
    rows_spec = pl.BlockSpec((None, None, HALO, bd), lambda b, d, t: (b, t, 0, d))
    inputs = [x, _halo(x, initial_state, bt), _following(x, bt), grad, _following(grad, bt)]
    specs = [token_spec, rows_spec, rows_spec, token_spec, rows_spec]
    inputs.append(weight.T)
    specs.append(pl.BlockSpec((width, bd), lambda b, d, t: (0, d)))
    if bias is not None:
        inputs.append(bias.reshape(1, channels))
        specs.append(pl.BlockSpec((1, bd), lambda b, d, t: (0, d)))
    if positions is not None:
        inputs += [positions[..., None], _following(positions[..., None], bt)]
        specs += [
            pl.BlockSpec((None, bt, 1), lambda b, d, t: (b, t, 0)),
            pl.BlockSpec((None, None, HALO, 1), lambda b, d, t: (b, t, 0, 0)),
        ]
    partial_shape = (batch, blocks, width, channels)
    out_shapes = [
        jax.ShapeDtypeStruct(x.shape, x.dtype),
        jax.ShapeDtypeStruct(partial_shape, acc),
    ]
    out_specs = [token_spec, pl.BlockSpec((None, None, width, bd), lambda b, d, t: (b, t, 0, d))]
    if bias is not None:
        out_shapes.append(jax.ShapeDtypeStruct((batch, blocks, 1, channels), acc))
        out_specs.append(pl.BlockSpec((None, None, 1, bd), lambda b, d, t: (b, t, 0, d)))
    if initial_state is not None:
        out_shapes.append(jax.ShapeDtypeStruct((batch, blocks, HALO, channels), acc))
        out_specs.append(rows_spec)
    rows = batch * (length + blocks * HALO) * channels  # z is recomputed for 8 rows more
    elements = batch * length * channels
    cost = pl.CostEstimate(
        # z (2 per tap) and dz (5 for SiLU's derivative) on every row computed; dx and the
        # taps' weight sums (2 per tap each) on the block's rows
        flops=rows * (2 * width + (5 if activation else 0)) + elements * 4 * width,
        transcendentals=rows if activation else 0,
        bytes_accessed=sum(a.size * a.dtype.itemsize for a in inputs)
        + sum(math.prod(s.shape) * s.dtype.itemsize for s in out_shapes),
    )
    kernel = functools.partial(
        _conv_bwd_kernel,
        width=width,
        activation=activation,
        packed=positions is not None,
        has_bias=bias is not None,
        has_state=initial_state is not None,
        length=length,
    )
    dx, dw, *rest = pl.pallas_call(
        kernel,
        grid=(batch, pl.cdiv(channels, bd), blocks),
        in_specs=specs,
        out_specs=out_specs,
        out_shape=out_shapes,
        compiler_params=tiling.compiler_params("parallel", "parallel", "parallel"),
        cost_estimate=cost,
        interpret=interpret,
        name="causal_conv1d_backward",
    )(*inputs)
    dweight = dw.sum(axis=(0, 1)).T.astype(weight.dtype)
    dbias = None if bias is None else rest.pop(0).sum(axis=(0, 1, 2)).astype(bias.dtype)
    dstate = None
    if initial_state is not None:
        kept = initial_state.shape[1]
        dstate = rest.pop(0)[:, 0, HALO - kept :].astype(initial_state.dtype)
    return dx, dweight, dbias, dstate


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def causal_conv1d(x, weight, bias, initial_state, positions, activation, config, interpret):
    """x [B, T, D], weight [D, W], bias [D] | None, initial_state [B, W - 1, D] | None, positions
    [B, T] int32 (packed batches) | None -> y [B, T, D]."""
    return _forward(x, weight, bias, initial_state, positions, activation, config, interpret)


def _conv_fwd(x, weight, bias, initial_state, positions, activation, config, interpret):
    out = _forward(x, weight, bias, initial_state, positions, activation, config, interpret)
    return out, (x, weight, bias, initial_state, positions)


def _conv_bwd(activation, config, interpret, residuals, grad):
    x, weight, bias, initial_state, positions = residuals
    grads = _backward(
        x, weight, bias, initial_state, positions, grad, activation, config, interpret
    )
    return (*grads, None)


causal_conv1d.defvjp(_conv_fwd, _conv_bwd)


def _update_kernel(*refs, width: int, activation, has_bias: bool):
    x_ref, state_ref, w_ref, *rest = refs
    bias_ref = rest.pop(0) if has_bias else None
    y_ref, new_state_ref = rest
    acc = w_ref.dtype if w_ref.dtype == jnp.float64 else jnp.float32
    kept, tokens = state_ref.shape[0], x_ref.shape[0]
    rows = [state_ref[i : i + 1, :].astype(w_ref.dtype) for i in range(kept)]
    rows += [x_ref[t : t + 1, :].astype(w_ref.dtype) for t in range(tokens)]
    w = w_ref[...].astype(acc)
    for t in range(tokens):
        y = jnp.zeros((1, w.shape[1]), acc) if bias_ref is None else bias_ref[...].astype(acc)
        for tap in range(width):
            y = y + rows[kept + t - (width - 1) + tap].astype(acc) * w[tap : tap + 1, :]
        y_ref[t : t + 1, :] = reference.activate(y, activation).astype(y_ref.dtype)
    for i, row in enumerate(rows[-kept:]):
        new_state_ref[i : i + 1, :] = row.astype(new_state_ref.dtype)


def causal_conv1d_update(x, conv_state, weight, bias, activation, config, interpret):
    """(y [B, T, D], new state [B, S, D]) for tokens x [B, T, D] after conv_state [B, S, D]."""
    batch, tokens, channels = x.shape
    kept, width = conv_state.shape[1], weight.shape[1]
    bd = config.block_channels
    inputs = [x, conv_state, weight.T]
    specs = [
        pl.BlockSpec((None, tokens, bd), lambda b, d: (b, 0, d)),
        pl.BlockSpec((None, kept, bd), lambda b, d: (b, 0, d)),
        pl.BlockSpec((width, bd), lambda b, d: (0, d)),
    ]
    if bias is not None:
        inputs.append(bias.reshape(1, channels))
        specs.append(pl.BlockSpec((1, bd), lambda b, d: (0, d)))
    elements = batch * tokens * channels
    cost = pl.CostEstimate(
        flops=elements * (2 * width + (4 if activation else 0)),
        transcendentals=elements if activation else 0,
        bytes_accessed=2 * elements * x.dtype.itemsize
        + 2 * batch * kept * channels * conv_state.dtype.itemsize
        + width * channels * weight.dtype.itemsize,
    )
    kernel = functools.partial(
        _update_kernel, width=width, activation=activation, has_bias=bias is not None
    )
    return pl.pallas_call(
        kernel,
        grid=(batch, pl.cdiv(channels, bd)),
        in_specs=specs,
        out_specs=(specs[0], specs[1]),
        out_shape=(
            jax.ShapeDtypeStruct(x.shape, x.dtype),
            jax.ShapeDtypeStruct(conv_state.shape, conv_state.dtype),
        ),
        input_output_aliases={1: 1},
        compiler_params=tiling.compiler_params("parallel", "parallel"),
        cost_estimate=cost,
        interpret=interpret,
        name="causal_conv1d_update",
    )(*inputs)
