"""Expert parallelism: a mixture-of-experts layer with experts sharded over an ``ep`` mesh axis.

Tokens and experts are both split over the axis: each shard routes its own tokens, sends every
(token, slot) row to the shard owning its expert, runs its local experts with ``gmm`` on the rows
it received (local group sizes), and sends the results back, where they are weighted and summed.
The exchange is ``exchange_rows``: ``ragged_all_to_all`` on TPU, a dense ``all_to_all`` emulation
on CPU (same result).

Capacity: buffers are static and sized for the worst case, so no token is ever dropped. A shard
of ``t`` tokens sends at most ``t * min(k, E_local)`` rows to any one shard (a token's k experts
are distinct, at most ``min(k, E_local)`` of them on one shard), so each shard's receive buffer
holds ``shards * t * min(k, E_local)`` rows. That costs memory (up to ``shards`` times a balanced
load) but keeps shapes static and results exact; a smaller, dropping capacity is not offered.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from kernel_hub.kernel_api import (
    KernelInputError,
    Transport,
    exchange_rows,
    find_mesh,
    require,
    shard_map_all,
)

from . import api

OP = "moe_ep"


def swiglu(hidden: jax.Array) -> jax.Array:
    """silu(gate) * up for ``w_in`` columns laid out [gate | up] (Mixtral's gate_up_proj)."""
    gate, up = jnp.split(hidden, 2, axis=-1)
    return jax.nn.silu(gate) * up


def _exclusive_cumsum(sizes, axis=-1):
    return jnp.cumsum(sizes, axis=axis) - sizes


def _local_experts(
    x,
    top_k_index,
    top_k_weights,
    w_in,
    w_out,
    *,
    axis,
    activation,
    transpose_rhs,
    transport,
    implementation,
):
    """The per-shard body: t local tokens, E_local local experts."""
    shards, me = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
    tokens, top_k = top_k_index.shape
    local = w_in.shape[0]
    chunk = tokens * min(top_k, local)
    capacity = shards * chunk

    flat = top_k_index.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    rows = x[order // top_k]  # (token, slot) rows sorted by expert
    counts = jnp.bincount(flat, length=shards * local).astype(jnp.int32).reshape(shards, local)
    send_sizes = counts.sum(1)
    input_offsets = _exclusive_cumsum(send_sizes)
    every = jax.lax.all_gather(counts, axis)  # [source, destination, local expert]
    pair = every.sum(2)  # rows source -> destination
    to_me = every[:, me, :]  # [source, local expert]
    recv_sizes = to_me.sum(1)
    output_offsets = _exclusive_cumsum(pair, axis=0)[me]  # where my rows land on each shard
    received = exchange_rows(
        rows,
        jnp.zeros((capacity, x.shape[1]), x.dtype),
        input_offsets,
        send_sizes,
        output_offsets,
        recv_sizes,
        axis=axis,
        chunk=chunk,
        transport=transport,
    )

    # Received rows come per source, each block in local-expert order: regroup by expert.
    ends = jnp.cumsum(to_me.reshape(-1))
    segment = jnp.searchsorted(ends, jnp.arange(capacity), side="right")
    expert = jnp.where(segment < ends.shape[0], segment % local, local)
    regroup = jnp.argsort(expert, stable=True)
    sizes = to_me.sum(0)
    options = {"transpose_rhs": transpose_rhs, "implementation": implementation}
    hidden = activation(api.gmm(received[regroup], w_in, sizes, **options))
    out = api.gmm(hidden.astype(w_out.dtype), w_out, sizes, **options)
    out = jnp.zeros_like(out).at[regroup].set(out)

    sent_from = _exclusive_cumsum(pair, axis=1)[:, me]  # where each source's rows started there
    back = exchange_rows(
        out,
        jnp.zeros((tokens * top_k, out.shape[1]), out.dtype),
        _exclusive_cumsum(recv_sizes),
        recv_sizes,
        sent_from,
        send_sizes,
        axis=axis,
        chunk=chunk,
        transport=transport,
    )
    back = jnp.zeros_like(back).at[order].set(back)
    weighted = back.reshape(tokens, top_k, -1) * top_k_weights[..., None].astype(back.dtype)
    return weighted.sum(1).astype(x.dtype)


def _check(x, top_k_index, top_k_weights, w_in, w_out, shards: int, transpose_rhs: bool):
    require(x.ndim == 2, f"{OP}: x must be [tokens, hidden], got shape {tuple(x.shape)}")
    require(
        top_k_index.ndim == 2
        and top_k_index.shape == top_k_weights.shape
        and top_k_index.shape[0] == x.shape[0],
        f"{OP}: top_k_index and top_k_weights must both be [tokens, k] with x's {x.shape[0]} "
        f"tokens; got {tuple(top_k_index.shape)} and {tuple(top_k_weights.shape)}",
    )
    hidden_in, hidden_out = (2, 1) if transpose_rhs else (1, 2)
    layout = "[E, n, H] and [E, H, m]" if transpose_rhs else "[E, H, n] and [E, m, H]"
    require(
        w_in.ndim == 3
        and w_out.ndim == 3
        and w_in.shape[0] == w_out.shape[0]
        and w_in.shape[hidden_in] == x.shape[1]
        and w_out.shape[hidden_out] == x.shape[1],
        f"{OP}: w_in and w_out must be {layout} with H = {x.shape[1]} (transpose_rhs="
        f"{transpose_rhs}); got {tuple(w_in.shape)} and {tuple(w_out.shape)}",
    )
    experts = w_in.shape[0]
    require(
        experts % shards == 0 and x.shape[0] % shards == 0,
        f"{OP}: {experts} experts and {x.shape[0]} tokens must both divide by the {shards} "
        f"shards of the expert axis",
    )


def moe_ep(
    x: jax.Array,
    top_k_index: jax.Array,
    top_k_weights: jax.Array,
    w_in: jax.Array,
    w_out: jax.Array,
    *,
    activation: Callable[[jax.Array], jax.Array],
    axis: str = "ep",
    transpose_rhs: bool = False,
    transport: Transport | None = None,
    implementation: str | None = None,
) -> jax.Array:
    """sum_k top_k_weights[t, k] * (activation(x[t] @ w_in[e]) @ w_out[e]), e = top_k_index[t, k].

    x [T, H], top_k_index / top_k_weights [T, k], w_in [E, H, n], w_out [E, m, H]
    (``activation`` maps [rows, n] -> [rows, m], e.g. SwiGLU of gate and up halves); with
    ``transpose_rhs`` the weights are [E, n, H] and [E, H, m] (Transformers' layout). Tokens and
    experts are split over mesh axis ``axis`` (the mesh of an Explicit-sharded input or of
    ``kernel_hub.use_mesh``); other mesh axes hold copies. Differentiable in x, the router
    weights and both expert weights. ``transport`` picks "ragged" (TPU) or "dense" (CPU).
    """
    found = find_mesh(OP, (x, top_k_index, top_k_weights, w_in, w_out))
    if found is None:
        raise KernelInputError(
            f"{OP}: needs a mesh with an {axis!r} axis: pass arrays sharded over an "
            f"Explicit-axis mesh, or call inside kernel_hub.use_mesh(mesh)"
        )
    mesh, explicit = found
    require(axis in mesh.axis_names, f"{OP}: mesh axes {mesh.axis_names} have no {axis!r}")
    _check(x, top_k_index, top_k_weights, w_in, w_out, mesh.shape[axis], transpose_rhs)

    def body(*arrays):
        return _local_experts(
            *arrays,
            axis=axis,
            activation=activation,
            transpose_rhs=transpose_rhs,
            transport=transport,
            implementation=implementation,
        )

    split = lambda rank: ((axis,),) + ((),) * (rank - 1)
    arrays = (x, top_k_index, top_k_weights, w_in, w_out)
    return shard_map_all(
        body, mesh, arrays, [split(a.ndim) for a in arrays], PartitionSpec(axis), explicit
    )


def expert_axis(weights) -> str | None:
    """The mesh axis splitting the experts (dimension 0) of a torchax tensor's JAX array, if any
    (what routes the Transformers integration to ``moe_ep``); None for other tensors."""
    to_array = getattr(weights, "jax", None)
    if not callable(to_array):
        return None
    # jax.typeof: the array may be a tracer (a jitted torchax step), which has no .sharding
    spec = tuple(getattr(jax.typeof(to_array()).sharding, "spec", ())) or (None,)
    first = spec[0]
    if first is None:
        return None
    require(
        isinstance(first, str),
        f"{OP}: experts split over several mesh axes {first}; split them over one ('ep')",
    )
    return first
