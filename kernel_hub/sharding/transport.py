"""Row exchange between the shards of a mesh axis: ``ragged_all_to_all`` semantics, two transports.

Every shard sends ``send_sizes[j]`` rows, starting at ``input_offsets[j]`` of ``operand``, to shard
``j``, where they land at ``output_offsets[j]`` of ``j``'s ``output``; it receives
``recv_sizes[i]`` rows from shard ``i``. ``"ragged"`` is ``jax.lax.ragged_all_to_all`` (TPU; not
implemented on XLA:CPU). ``"dense"`` emulates it with one ``all_to_all`` of fixed ``chunk``-row
blocks (every pair of shards exchanges ``chunk`` rows, the unused ones masked), which runs on CPU
and gives the same result, so the expert-parallel layer can be tested exactly here.
"""

from __future__ import annotations

from typing import Any, Literal

from ..errors import UnknownNameError
from ..platform import jax_platform

Transport = Literal["ragged", "dense"]
TRANSPORTS: tuple[Transport, ...] = ("ragged", "dense")


def default_transport() -> Transport:
    """``ragged`` on TPU and GPU, ``dense`` on CPU (XLA:CPU lacks ragged-all-to-all)."""
    return "dense" if jax_platform() == "cpu" else "ragged"


def _dense(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis, chunk):
    import jax
    import jax.numpy as jnp

    steps = jnp.arange(chunk)
    # [shards, chunk] rows to send to each shard; rows past its size are masked to zero.
    index = input_offsets[:, None] + steps[None, :]
    keep = steps[None, :] < send_sizes[:, None]
    blocks = jnp.take(operand, index.reshape(-1), axis=0, mode="clip")
    blocks = jnp.where(keep.reshape(-1, *([1] * (operand.ndim - 1))), blocks, 0)
    blocks = blocks.reshape(send_sizes.shape[0], chunk, *operand.shape[1:])
    received = jax.lax.all_to_all(blocks, axis, 0, 0, tiled=False)
    # Where each source's rows land here: the offsets it computed for us.
    land = jax.lax.all_to_all(output_offsets[:, None], axis, 0, 0, tiled=False)[:, 0]
    target = land[:, None] + steps[None, :]
    target = jnp.where(steps[None, :] < recv_sizes[:, None], target, output.shape[0])
    rows = received.reshape(-1, *operand.shape[1:])
    return output.at[target.reshape(-1)].set(rows, mode="drop")


def exchange_rows(
    operand: Any,
    output: Any,
    input_offsets: Any,
    send_sizes: Any,
    output_offsets: Any,
    recv_sizes: Any,
    *,
    axis: str,
    chunk: int,
    transport: Transport | None = None,
) -> Any:
    """``output`` with the rows other shards of ``axis`` sent here (call inside a shard_map).

    ``chunk`` bounds the rows any one shard sends to any other (the dense transport's block).
    """
    import jax

    transport = transport or default_transport()
    if transport == "ragged":
        return jax.lax.ragged_all_to_all(
            operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name=axis
        )
    if transport == "dense":
        return _dense(
            operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis, chunk
        )
    raise UnknownNameError("transport", str(transport), TRANSPORTS)
