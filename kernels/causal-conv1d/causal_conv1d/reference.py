"""Plain jnp depthwise causal convolution: the XLA implementation and the backward of the Pallas
one. Layout is token-major, ``x [B, T, D]`` (channels on TPU lanes); Transformers' functions take
``[B, D, T]`` and the integration transposes.

Numerics follow Transformers' ``causal_conv1d_fn`` / ``causal_conv1d_update`` fallbacks
(qwen3_next): the input is cast to the weight's dtype, ``weight[:, W - 1]`` multiplies the
current token, the bias is added, then SiLU if asked; the result is cast back to x's dtype.
Sums run in f32 (f64 for f64), where torch's CPU conv1d accumulates in the weight's dtype: bf16
results differ by bf16 rounding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

ACTIVATIONS = (None, "silu", "swish")


def compute_dtype(dtype) -> jnp.dtype:
    return jnp.dtype(jnp.float64) if jnp.dtype(dtype) == jnp.float64 else jnp.dtype(jnp.float32)


def activate(y, activation: str | None):
    return y * jax.nn.sigmoid(y) if activation in ("silu", "swish") else y


def positions_in_sequence(batch: int, length: int, cu_seqlens) -> jax.Array:
    """[B, T] int32: each token's index inside its sequence (a batch row is one sequence unless
    ``cu_seqlens`` packs several into a batch of one)."""
    token = jnp.arange(length, dtype=jnp.int32)
    if cu_seqlens is None:
        return jnp.broadcast_to(token, (batch, length))
    cu = cu_seqlens.astype(jnp.int32)
    owner = jnp.clip(jnp.searchsorted(cu[1:], token, side="right"), 0, cu.shape[0] - 2)
    return (token - cu[owner])[None]


def conv(x, weight, bias, initial_state, positions, activation):
    """The convolution; ``positions`` ([B, T] from ``positions_in_sequence``, packed batches only)
    zeroes taps that reach before a token's sequence start."""
    acc = compute_dtype(weight.dtype)
    length, width = x.shape[1], weight.shape[1]
    history = (
        jnp.zeros((x.shape[0], width - 1, x.shape[2]), acc)
        if initial_state is None
        else initial_state.astype(weight.dtype).astype(acc)
    )
    extended = jnp.concatenate([history, x.astype(weight.dtype).astype(acc)], axis=1)
    w = weight.astype(acc)
    y = jnp.zeros(x.shape, acc) if bias is None else jnp.broadcast_to(bias.astype(acc), x.shape)
    for tap in range(width):
        shift = width - 1 - tap  # how many tokens back this tap reads
        window = extended[:, tap : tap + length]
        if positions is not None and shift:
            window = jnp.where(positions[..., None] >= shift, window, 0)
        y = y + window * w[:, tap]
    return activate(y, activation).astype(x.dtype)


def causal_conv1d(x, weight, bias=None, initial_state=None, cu_seqlens=None, *, activation=None):
    """y [B, T, D] for x [B, T, D], weight [D, W], bias [D], initial_state [B, W - 1, D] (the
    inputs before x; zeros when None). A packed batch (``cu_seqlens``) starts every sequence from
    zeros."""
    positions = (
        None if cu_seqlens is None else positions_in_sequence(x.shape[0], x.shape[1], cu_seqlens)
    )
    return conv(x, weight, bias, initial_state, positions, activation)


def causal_conv1d_update(x, conv_state, weight, bias=None, *, activation=None):
    """(y [B, T, D], new conv state [B, S, D]) for a few new tokens x [B, T, D] after the S >= W - 1
    inputs held in ``conv_state`` (Transformers keeps S = W); the new state is the last S inputs."""
    acc = compute_dtype(weight.dtype)
    length, width, kept = x.shape[1], weight.shape[1], conv_state.shape[1]
    extended = jnp.concatenate([conv_state.astype(weight.dtype), x.astype(weight.dtype)], axis=1)
    history = extended[:, kept - (width - 1) :].astype(acc)
    w = weight.astype(acc)
    y = jnp.zeros(x.shape, acc) if bias is None else jnp.broadcast_to(bias.astype(acc), x.shape)
    for tap in range(width):
        y = y + history[:, tap : tap + length] * w[:, tap]
    return activate(y, activation).astype(x.dtype), extended[:, -kept:].astype(conv_state.dtype)
