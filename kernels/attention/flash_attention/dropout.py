"""Attention dropout's mask: a counter-based hash of (seed, batch, query head, query, key).

Nothing is stored: the flash kernels compute the bits of each score block from the block's
indices, in the forward and again in the backward, and the XLA reference computes the same bits
for the whole ``[B, Hq, Sq, Sk]`` array. All arithmetic is int32 with wrapping multiplies and
logical shifts (what Mosaic lowers and the CPU interpreter runs alike), so a seed gives one mask
everywhere. The kernels take the seed as ``words``: (seed, first batch index, first query head) of
the arrays they see, so a shard of a batch- or head-split call hashes global indices and draws
the unsharded call's mask. The mixer is murmur3's 32-bit finaliser, a bijection: within a row
every key gets a distinct word.

A key is kept when the top 24 bits of its word are at least ``threshold(rate)``, so the keep
probability is ``1 - threshold / 2**24`` (``rate`` rounded to a multiple of 2**-24); kept
probabilities are scaled by ``1 / (1 - rate)``, as ``torch.nn.functional.dropout`` scales.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernel_hub.kernel_api import require

_GOLDEN = -1640531527  # 0x9E3779B9 as int32: odd, so k * _GOLDEN is a bijection of k
_M1 = -2048144789  # 0x85EBCA6B
_M2 = -1028477387  # 0xC2B2AE35
_BITS = 24


def _mix(x):
    """murmur3 fmix32 on int32 words."""
    srl = jax.lax.shift_right_logical
    x = x ^ srl(x, jnp.int32(16))
    x = x * jnp.int32(_M1)
    x = x ^ srl(x, jnp.int32(13))
    x = x * jnp.int32(_M2)
    return x ^ srl(x, jnp.int32(16))


def row_key(seed, batch, head, query):
    """The word of each (batch, query head, query) row (int32 arrays, broadcast together)."""
    key = _mix(seed.astype(jnp.int32))
    for index in (batch, head, query):
        key = _mix(key ^ index.astype(jnp.int32))
    return key


def words(seed, batch_offset=0, head_offset=0):
    """int32 [3]: the seed and the global index of the first batch entry and query head."""
    return jnp.stack(
        [jnp.asarray(x).astype(jnp.int32).reshape(()) for x in (seed, batch_offset, head_offset)]
    )


def as_words(seed):
    """``seed`` (int []) or ``words`` (int32 [3]) as ``words``."""
    seed = jnp.asarray(seed)
    return seed.astype(jnp.int32) if seed.shape == (3,) else words(seed)


def threshold(rate: float) -> int:
    return round(rate * (1 << _BITS))


def keep(row_keys, keys, rate: float):
    """Which (row, key) pairs survive: ``row_keys`` [..., 1] from ``row_key``, ``keys`` [..., n]
    the key indices (int32)."""
    word = _mix(row_keys ^ (keys * jnp.int32(_GOLDEN)))
    return jax.lax.shift_right_logical(word, jnp.int32(32 - _BITS)) >= threshold(rate)


def scale(rate: float) -> float:
    """What a kept probability is multiplied by."""
    return 1.0 / (1.0 - rate)


def check_rate(rate: float, where: str) -> None:
    require(
        isinstance(rate, (int, float)) and not isinstance(rate, bool) and 0.0 <= rate < 1.0,
        f"{where}: dropout_rate={rate!r}; it must be a number in [0, 1)",
    )


def mask(seed, batch: int, heads: int, q_len: int, kv_len: int, rate: float):
    """The whole keep mask [B, Hq, Sq, Sk] (the reference's; O(S^2)); ``seed`` as ``as_words``
    takes it."""
    seed, batch_offset, head_offset = as_words(seed)
    b, h, q, k = (
        jax.lax.broadcasted_iota(jnp.int32, (batch, heads, q_len, kv_len), axis)
        for axis in range(4)
    )
    rows = row_key(seed, b[..., :1] + batch_offset, h[..., :1] + head_offset, q[..., :1])
    return keep(rows, k, rate)
