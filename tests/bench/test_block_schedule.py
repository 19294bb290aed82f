"""The block-schedule counter on calls whose traffic is obvious by hand."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernel_hub.bench import block_schedule


def _call(x, w, grid, x_block):
    """out[i] = x[i] @ w, x in row blocks ``x_block`` over a grid whose last axis repeats them."""

    def kernel(x_ref, w_ref, o_ref):
        o_ref[...] = jnp.dot(x_ref[...], w_ref[...])

    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[
            pl.BlockSpec((x_block, 128), lambda i, j: (i, 0)),
            pl.BlockSpec((128, 128), lambda i, j: (0, 0)),
        ],
        out_specs=pl.BlockSpec((x_block, 128), lambda i, j: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((x.shape[0], 128), x.dtype),
        interpret=True,
    )(x, w)


def test_unchanged_blocks_are_not_refetched_and_edges_are_clipped():
    x = jnp.zeros((40, 128), jnp.float32)  # 3 row blocks of 16, the last one 8 rows
    w = jnp.zeros((128, 128), jnp.float32)
    (call,) = block_schedule.pallas_calls(lambda a, b: _call(a, b, (3, 2), 16), x, w)
    # x once (its index holds over j), w once (constant), out once: 40*128 + 128*128 + 40*128
    assert block_schedule.bytes_moved(call) == 4 * (40 * 128 + 128 * 128 + 40 * 128)
    # one [16, 128] x [128, 128] dot per step, six steps (the ragged block runs whole)
    assert block_schedule.matmul_flops(call) == 6 * 2 * 16 * 128 * 128
