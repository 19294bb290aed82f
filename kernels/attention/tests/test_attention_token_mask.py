"""The Pallas kernel (interpret mode, TPU-sized 128 blocks, several per axis) under per-token
masks (key padding, packed/chunk segment ids, explicit positions, bidirectional groups) against
the float64 reference: values, logsumexp and gradients. And fully masked blocks are skipped."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from attention_helpers import assert_pallas_matches_float64, loss_outputs_and_grads

BLOCKS = {"block_q": 128, "block_k": 128}
B, HQ, HKV, S, D = 2, 4, 2, 384, 32


def _qkv(dtype, seed=0):
    rng = np.random.default_rng(seed)

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), dtype)

    return normal(B, HQ, S, D), normal(B, HKV, S, D), normal(B, HKV, S, D)


def _padding():
    valid = np.ones((B, S), bool)
    valid[0, :50] = False  # left padding
    valid[1, 300:] = False  # right padding
    return valid


def _groups():
    groups = np.full((B, S), -1)
    groups[0, 60:200] = 0  # an image block across q and kv block boundaries
    groups[0, 250:260] = 1
    groups[1, 0:130] = 0
    return groups


def _long_groups():
    """Groups spanning three blocks: a group's keys a whole block or more ahead of its queries,
    past the window (under a causal rule the window bounds only the past)."""
    groups = np.full((B, S), -1)
    groups[0, 20:380] = 0
    groups[1, 100:300] = 0
    return groups


def _decode_groups():
    groups = _groups()
    groups[0, 196:204] = 2  # decoding queries 200..203 inside an image block
    return groups


def _segments():
    return np.repeat(np.arange(3), [100, 200, 84])[None].repeat(B, 0)


CASES = {
    "padding-causal": ({"kv_mask": _padding()}, {"causal": True}),
    "padding-window": ({"kv_mask": _padding()}, {"causal": True, "sliding_window": 96}),
    "segments-chunks": ({"q_segment_ids": _segments(), "kv_segment_ids": _segments()}, {
        "causal": True}),
    "groups-padding": ({"kv_mask": _padding(), "q_groups": _groups(), "kv_groups": _groups()},
                       {"causal": True}),
    "groups-window-bounds-groups": (
        {"q_groups": _groups(), "kv_groups": _groups()},
        {"causal": True, "sliding_window": 64, "window_bounds_groups": True},
    ),
    "long-groups-window-bounds-groups": (
        {"q_groups": _long_groups(), "kv_groups": _long_groups()},
        {"causal": True, "sliding_window": 16, "window_bounds_groups": True},
    ),
    "long-groups-window-bounds-groups-positions": (
        {"q_groups": _long_groups(), "kv_groups": _long_groups(),
         "q_positions": np.arange(S)[None].repeat(B, 0),
         "kv_positions": np.arange(S)[None].repeat(B, 0)},
        {"causal": True, "sliding_window": 16, "window_bounds_groups": True},
    ),
    "static-cache-positions": (
        # 128 queries at positions 100..227 of a 384-slot cache: later slots are empty.
        {"q_positions": np.arange(100, 228)[None].repeat(B, 0),
         "kv_positions": np.arange(S)[None].repeat(B, 0), "kv_mask": _padding(),
         "q_len": 128},
        {"causal": True},
    ),
    "decode-positions-groups": (
        # 4 queries at positions 200..203 (q blocks hold whole head groups) over a padded cache.
        {"q_positions": np.arange(200, 204)[None].repeat(B, 0),
         "kv_positions": np.arange(S)[None].repeat(B, 0), "kv_mask": _padding(),
         "q_groups": _decode_groups()[:, 200:204], "kv_groups": _decode_groups(), "q_len": 4},
        {"causal": True, "sliding_window": 150},
    ),
    "two-way-window-padding": ({"kv_mask": _padding()}, {"sliding_window": 40}),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_pallas_matches_float64_reference(attention, case):
    arrays, options = dict(CASES[case][0]), CASES[case][1]
    q, k, v = _qkv(jnp.float32)
    q_len = arrays.pop("q_len", S)
    q = q[:, :, :q_len]
    assert_pallas_matches_float64(attention, q, k, v, arrays, options, case, **BLOCKS)


def test_fully_masked_blocks_are_skipped(attention):
    """Keys 256.. of batch 1 are padding and hold NaN: a visited block would put NaN into the
    output (0 * NaN in p @ v), so a finite result shows the block was never computed."""
    q, k, v = _qkv(jnp.float32)
    valid = np.ones((B, S), bool)
    valid[1, 256:] = False
    poison = jnp.asarray(~valid)[:, None, :, None]
    k, v = jnp.where(poison, jnp.nan, k), jnp.where(poison, jnp.nan, v)
    for options in ({"causal": True}, {}):
        out = loss_outputs_and_grads(
            attention, q, k, v, {"kv_mask": valid}, options, "pallas", **BLOCKS
        )
        for name, x in zip(("out", "lse", "dq", "dk", "dv"), out, strict=True):
            finite = np.isfinite(np.asarray(x)) | (name == "lse")
            if name in ("dk", "dv"):  # gradients of the poisoned keys themselves are zero or NaN
                finite = finite | np.asarray(poison)
            assert finite.all(), f"{options} {name}: a fully padded block was computed"
