"""Pallas TPU depthwise causal convolution.

Full sequence: grid (batch, channel block, token block). A tap that reads ``s`` tokens back is the
token block rolled down by ``s`` rows (``pltpu.roll``, no unaligned slicing); its first ``s`` rows
come from an 8-row halo holding the inputs just before the block (the previous block's tail, or
the initial state for the first block), gathered by XLA beforehand so every grid step is
independent ("parallel" on every axis). Packed sequences pass each token's position in its
sequence: a tap reaching before the sequence start contributes zero. The backward is ``jax.vjp``
of the XLA form (``reference``); a Pallas backward is not written yet.

Decode update: grid (batch, channel block); the conv state rows and the new tokens are read row by
row, the outputs are the taps' sums, and the state (aliased to the input state) is rewritten with
the last rows.
"""

from __future__ import annotations

import functools
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
    _, vjp = jax.vjp(
        lambda x, w, b, s: reference.conv(x, w, b, s, positions, activation),
        x,
        weight,
        bias,
        initial_state,
    )
    return (*vjp(grad), None)


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
