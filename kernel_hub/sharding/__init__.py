"""Sharded kernels: one declarative rule per op drives ``jax.shard_map`` at the kernel boundary
(``boundary``) and the op's DTensor strategy (``dtensor``); ``transport`` moves expert-parallel
rows between shards. See docs/running-on-a-pod.md.
"""

from .boundary import find_mesh, partition_spec, run_sharded, shard_map_all, sharded
from .cases import MeshCase
from .context import MeshContext, current_mesh_context, use_mesh
from .rule import ShardingError, ShardingRule
from .transport import TRANSPORTS, Transport, default_transport, exchange_rows

__all__ = [
    "TRANSPORTS",
    "MeshCase",
    "MeshContext",
    "ShardingError",
    "ShardingRule",
    "Transport",
    "current_mesh_context",
    "default_transport",
    "exchange_rows",
    "find_mesh",
    "partition_spec",
    "run_sharded",
    "shard_map_all",
    "sharded",
    "use_mesh",
]
