"""Sharded kernels: one declarative rule per op drives ``jax.shard_map`` at the kernel boundary
(``boundary``) and the op's DTensor strategy (``dtensor``); ``transport`` moves expert-parallel
rows between shards. See docs/running-on-a-pod.md.
"""

from .boundary import partition_spec, run_sharded, sharded
from .cases import MeshCase
from .context import MeshContext, current_mesh_context, use_mesh
from .rule import ShardingError, ShardingRule

__all__ = [
    "MeshCase",
    "MeshContext",
    "ShardingError",
    "ShardingRule",
    "current_mesh_context",
    "partition_spec",
    "run_sharded",
    "sharded",
    "use_mesh",
]
