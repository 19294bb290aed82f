"""Expert parallelism around the fused kernel, for decode: experts split over an ``ep`` mesh axis,
every shard sees all of the step's tokens.

Each shard runs ``fused_experts`` on its local experts (global ids shifted by the shard's first
expert; ids outside the shard's range contribute nothing, which the kernel already guarantees),
producing f32 partial sums, and one ``psum`` over the axis adds them. Each expert's weights are
read by the one device that holds them; the traffic is the ``[T, H]`` activations (gathered if
tokens arrive split) and one f32 ``[T, H]`` all-reduce per layer: small at decode sizes. It is
not moe-gemm's ``moe_ep`` (a ragged all-to-all of rows, which prefill needs); forward only, like
the fused kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from kernel_hub.kernel_api import KernelInputError, find_mesh, require, shard_map_all

from . import api

OP = "fused_experts_ep"


def fused_experts_ep(
    hidden_states: jax.Array,
    top_k_index: jax.Array,
    top_k_weights: jax.Array,
    w_gate_up: jax.Array,
    w_down: jax.Array,
    gate_up_bias: jax.Array | None = None,
    down_bias: jax.Array | None = None,
    gate_up_scale: jax.Array | None = None,
    down_scale: jax.Array | None = None,
    *,
    axis: str = "ep",
    implementation: str | None = None,
    **options,
) -> jax.Array:
    """``api.fused_experts`` with the experts (dimension 0 of the weights, biases and scales)
    split over mesh axis ``axis`` (the mesh of Explicit-sharded inputs or of
    ``kernel_hub.use_mesh``); ``options`` are ``fused_experts``'s keyword arguments. The result
    is [T, H], replicated."""
    optional = (gate_up_bias, down_bias, gate_up_scale, down_scale)
    arrays = (hidden_states, top_k_index, top_k_weights, w_gate_up, w_down)
    present = [a for a in optional if a is not None]
    found = find_mesh(OP, (*arrays, *present))
    if found is None:
        raise KernelInputError(
            f"{OP}: needs a mesh with an {axis!r} axis: pass arrays sharded over an "
            "Explicit-axis mesh, or call inside kernel_hub.use_mesh(mesh)"
        )
    mesh, explicit = found
    require(axis in mesh.axis_names, f"{OP}: mesh axes {mesh.axis_names} have no {axis!r}")
    shards, experts = mesh.shape[axis], w_gate_up.shape[0]
    require(
        experts % shards == 0,
        f"{OP}: {experts} experts must divide by the {shards} shards of axis {axis!r}",
    )
    config = api.make_config(
        options.pop("activation", "silu"),
        options.pop("alpha", 1.702),
        options.pop("limit", 7.0),
        options.pop("transposed", False),
        options.pop("interleaved", False),
        options.pop("quantization", None),
    )
    blocks = options.pop("blocks", None)
    require(not options, f"{OP}: unknown options {sorted(options)}")
    api.check_inputs(*arrays, *optional, config)

    def body(x, ids, weights, w1, w2, *rest):
        it = iter(rest)
        local = [None if a is None else next(it) for a in optional]
        first = jax.lax.axis_index(axis) * w1.shape[0]
        partial = api.TABLE(
            x, ids - first, weights, w1, w2, *local,
            config=config, out_dtype=jnp.float32, blocks=blocks, implementation=implementation,
        )  # fmt: skip
        return jax.lax.psum(partial, axis).astype(x.dtype)

    split = lambda rank: ((axis,),) + ((),) * (rank - 1)
    whole = lambda rank: ((),) * rank
    specs = [whole(a.ndim) for a in arrays[:3]] + [split(a.ndim) for a in (*arrays[3:], *present)]
    return shard_map_all(body, mesh, (*arrays, *present), specs, PartitionSpec(), explicit)
