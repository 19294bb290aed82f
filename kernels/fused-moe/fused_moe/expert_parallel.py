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

import inspect

import jax
from jax.sharding import PartitionSpec

from kernel_hub.kernel_api import KernelInputError, find_mesh, require, shard_map_all

from . import api

OP = "fused_experts_ep"
_EXPERTS = inspect.signature(api.fused_experts)
_EXPERTS = _EXPERTS.replace(
    parameters=[p for n, p in _EXPERTS.parameters.items() if n != "split_axes"]
)
"""``fused_experts_ep`` takes ``fused_experts``'s arguments (and ``axis``), less the boundary's
``split_axes``: read from there."""
_ARRAYS = [n for n, p in _EXPERTS.parameters.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
_REQUIRED = sum(_EXPERTS.parameters[n].default is inspect.Parameter.empty for n in _ARRAYS)
_CONFIG = tuple(inspect.signature(api.make_config).parameters)
_PASSED = [n for n in _EXPERTS.parameters if n not in _ARRAYS and n not in _CONFIG]
"""Keywords ``fused_experts`` hands to its table as they are (blocks, implementation)."""


def fused_experts_ep(*args, axis: str = "ep", **kwargs) -> jax.Array:
    """``api.fused_experts`` with the experts (dimension 0 of the weights, biases and scales)
    split over mesh axis ``axis`` (the mesh of Explicit-sharded inputs or of
    ``kernel_hub.use_mesh``); the other arguments are ``fused_experts``'s. The result is [T, H],
    replicated."""
    unknown = sorted(set(kwargs) - set(_EXPERTS.parameters))
    require(not unknown, f"{OP}: unknown options {unknown}")
    bound = _EXPERTS.bind(*args, **kwargs)
    bound.apply_defaults()
    values = bound.arguments
    arrays = tuple(values[n] for n in _ARRAYS[:_REQUIRED])
    optional = tuple(values[n] for n in _ARRAYS[_REQUIRED:])
    present = [a for a in optional if a is not None]
    found = find_mesh(OP, (*arrays, *present))
    if found is None:
        raise KernelInputError(
            f"{OP}: needs a mesh with an {axis!r} axis: pass arrays sharded over an "
            "Explicit-axis mesh, or call inside kernel_hub.use_mesh(mesh)"
        )
    mesh, explicit = found
    require(axis in mesh.axis_names, f"{OP}: mesh axes {mesh.axis_names} have no {axis!r}")
    shards, experts = mesh.shape[axis], values["w_gate_up"].shape[0]
    require(
        experts % shards == 0,
        f"{OP}: {experts} experts must divide by the {shards} shards of axis {axis!r}",
    )
    config = api.make_config(**{n: values[n] for n in _CONFIG})
    passed = {n: values[n] for n in _PASSED}
    api.check_inputs(*arrays, *optional, config)

    def body(x, ids, weights, w1, w2, *rest):
        it = iter(rest)
        local = [None if a is None else next(it) for a in optional]
        return api.local_experts_sum(
            x, ids, weights, w1, w2, *local, axes=axis, config=config, **passed
        )

    split = lambda rank: ((axis,),) + ((),) * (rank - 1)
    whole = lambda rank: ((),) * rank
    specs = [whole(a.ndim) for a in arrays[:3]] + [split(a.ndim) for a in (*arrays[3:], *present)]
    return shard_map_all(body, mesh, (*arrays, *present), specs, PartitionSpec(), explicit)


fused_experts_ep.__signature__ = _EXPERTS.replace(  # type: ignore[attr-defined]
    parameters=[
        *_EXPERTS.parameters.values(),
        inspect.Parameter("axis", inspect.Parameter.KEYWORD_ONLY, default="ep", annotation=str),
    ]
)
