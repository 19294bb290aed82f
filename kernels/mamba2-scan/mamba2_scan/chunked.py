"""The chunked Mamba-2 scan (state-space duality) in plain jnp: the XLA implementation and the
backward of the Pallas forward (``jax.vjp`` of this on the same prepared inputs).

Per chunk of ``chunk`` tokens, with ``cum`` the running sum of ``dt A`` inside the chunk:
the chunk's own tokens mix through ``(C B^T) * exp(cum_l - cum_s)`` (causal, same sequence), the
state entering the chunk reaches token l scaled by ``exp(cum_l)``, and the chunk's tokens add
``exp(cum_last - cum_s) dt_s x_s B_s^T`` to the state leaving it. Packed rows (``seq_idx``) are
masks on those three terms, so a sequence boundary inside a chunk needs no special layout.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .reference import HIGHEST, repeat_groups


def padded_sequences(seq_idx, batch: int, length: int, padded: int) -> jax.Array:
    """[B, padded] int32 sequence index (zeros when None); the padding tail repeats the last
    token's index so it changes nothing (its dt and x are zero)."""
    if seq_idx is None:
        return jnp.zeros((batch, padded), jnp.int32)
    seq_idx = seq_idx.astype(jnp.int32)
    return jnp.pad(seq_idx, ((0, 0), (0, padded - length)), mode="edge")


def masks(seq: jax.Array, chunk: int) -> tuple[jax.Array, jax.Array]:
    """From a padded [B, Lp] sequence index: ``reach`` [B, Lp] (the state entering token t's chunk
    belongs to t's sequence: the previous chunk's last token, or token 0 for the first chunk, has
    t's index) and ``to_end`` [B, Lp] (token t's sequence runs to its chunk's last token), as
    0/1 floats."""
    batch, padded = seq.shape
    chunks = seq.reshape(batch, padded // chunk, chunk)
    last = chunks[:, :, -1:]
    before = jnp.concatenate([chunks[:, :1, :1], last[:, :-1]], axis=1)
    reach = (chunks == before).astype(jnp.float32).reshape(batch, padded)
    to_end = (chunks == last).astype(jnp.float32).reshape(batch, padded)
    return reach, to_end


def pad_tokens(t: jax.Array, padded: int) -> jax.Array:
    widths = [(0, 0)] * t.ndim
    widths[1] = (0, padded - t.shape[1])
    return jnp.pad(t, widths)


def chunk_scan(x, dt, A, B, C, initial_state, seq, chunk: int):
    """Prepared inputs in the compute dtype: x ``[B, L, H, P]``, dt ``[B, L, H]`` (after bias,
    softplus, clamp), A ``[H]``, B/C ``[B, L, G, N]``, initial_state ``[B, H, P, N]``, seq the
    padded ``[B, Lp]`` sequence index (``padded_sequences``). Returns (y ``[B, L, H, P]`` without
    the D term, final state ``[B, H, P, N]``)."""
    acc = initial_state.dtype
    batch, length, heads, width = x.shape
    padded = seq.shape[1]
    chunks = padded // chunk
    B, C = (repeat_groups(t, heads, 2) for t in (B, C))
    x, dt, B, C = (pad_tokens(t.astype(acc), padded) for t in (x, dt, B, C))
    reach, to_end = (m.astype(acc) for m in masks(seq, chunk))

    def blocks(t):
        return t.reshape(batch, chunks, chunk, *t.shape[2:])

    xdt = blocks(x * dt[..., None])  # [b, c, l, h, p]
    B, C = blocks(B), blocks(C)  # [b, c, l, h, n]
    cum = jnp.cumsum(blocks(dt * A), axis=2)  # [b, c, l, h]
    seqc = blocks(seq)
    reach, to_end = blocks(reach), blocks(to_end)

    causal = jnp.tril(jnp.ones((chunk, chunk), bool))
    same = seqc[:, :, :, None] == seqc[:, :, None, :]  # [b, c, l, s]
    diff = cum[:, :, :, None, :] - cum[:, :, None, :, :]  # [b, c, l, s, h]
    allowed = (causal[None, None] & same)[..., None]
    decay = jnp.exp(jnp.where(allowed, diff, -jnp.inf))
    scores = jnp.einsum("bclhn,bcshn->bclsh", C, B, precision=HIGHEST) * decay
    y_diag = jnp.einsum("bclsh,bcshp->bclhp", scores, xdt, precision=HIGHEST)

    last = cum[:, :, -1, :]  # [b, c, h]
    weight = jnp.exp(last[:, :, None, :] - cum) * to_end[..., None]
    chunk_states = jnp.einsum("bclh,bclhn,bclhp->bchpn", weight, B, xdt, precision=HIGHEST)
    carry = reach[:, :, -1]  # [b, c]: the state passes through the whole chunk

    def step(state, inputs):
        chunk_state, last_c, carry_c = inputs
        entering = state
        state = state * (jnp.exp(last_c) * carry_c[:, None])[..., None, None] + chunk_state
        return state, entering

    final, entering = jax.lax.scan(
        step,
        initial_state,
        (jnp.moveaxis(chunk_states, 1, 0), jnp.moveaxis(last, 1, 0), jnp.moveaxis(carry, 1, 0)),
    )
    entering = jnp.moveaxis(entering, 0, 1)  # [b, c, h, p, n]
    y_off = jnp.einsum("bclhn,bchpn->bclhp", C, entering, precision=HIGHEST)
    y_off = y_off * (jnp.exp(cum) * reach[..., None])[..., None]
    y = (y_diag + y_off).reshape(batch, padded, heads, width)[:, :length]
    return y, final
