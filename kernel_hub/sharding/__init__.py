"""Sharded kernels: one declarative rule per op drives ``jax.shard_map`` at the kernel boundary
(``boundary``) on Explicit meshes, on Auto meshes under plain ``jit`` and inside ``use_mesh``, and
the op's DTensor strategy (``dtensor``); ``transport`` moves expert-parallel rows between shards.
See docs/running-on-a-pod.md.

Giving a new kernel's op a rule (``tests/sharding/test_coverage.py`` fails for a torch op without
one): declare it on the op, importing only ``kernel_hub.kernel_api``::

    from kernel_hub.kernel_api import Einsum, op

    @op(
        sharding=Einsum(
            "... hidden, hidden inner, hidden inner, inner hidden -> ... hidden",
            reduced=("inner",),  # split inner: each shard's partial output, summed (psum)
            whole=("hidden",),
            handled_by={"hidden": "an all-gather of x first"},
        ),
        ...,
    )
    def gated_mlp(x: jax.Array, ...) -> jax.Array: ...

(``ShardingRule.parse(op, text, ...)`` and the ``sharded(rule)`` decorator remain for JAX
functions that are no op of their own, such as a custom backward entry point.)

1. Name every dimension of every array operand, in the JAX function's parameter order (its first
   ``len(operands)`` parameters; an optional one may be None), then every result, einsum style.
   ``...`` (first, once) stands for any number of leading dimensions.
2. A factor is free (split wherever an input is split; an operand holding it unsplit is sliced to
   match), ``whole`` (never split: the normalised axis, a scanned sequence; ``handled_by`` names the
   layer that does shard it, quoted in the error), ``reduced`` (in no result: split, each shard
   returns a partial result and they are summed), ``combined`` (split; the function is called with
   ``split_axes`` and combines the shards itself, e.g. a log-sum-exp over vocabulary shards),
   ``located`` (split; the function is called with ``split_axes`` to find its shard's global
   offset, e.g. attention dropout hashing global batch and head indices), or split ``together``
   with another (query and kv heads). A result lacking a split factor that other
   results keep is summed over its axes (a weight's gradient). ``factor?`` marks a dimension that
   may have size 1 and broadcast.
3. A rule that depends on an option (a layout flag) is a function of the keyword options
   returning one: ``sharding=lambda transpose_rhs=False, **_: Einsum(...)``; one that also takes
   ``ranks`` gets the ranks of the call's array arguments (an operand whose rank depends on a
   format, such as a quantized weight's per-channel or per-block scale; ``choose_rule``).
4. Decorate the backward entry point too when the torch op has a ``jax_backward``; ops whose JAX
   function goes through ``jax.vjp`` get the transpose of the forward's ``shard_map``.
5. Add a ``mesh_cases()`` returning ``MeshCase``s (small bf16 shapes, specs, the collectives the
   compiled program must hold) beside the benchmark cases (``benchmark.py``: test data, so the
   module with the boundary never imports the API back) and declare it as ``KERNEL``'s
   ``mesh_cases``: ``kernel-hub
   compile-check --mesh`` compiles them for four TPU generations on Explicit and Auto meshes.
   Add a values check to ``tests/sharding/spmd_checks.py`` (8 CPU devices, vs unsharded).

Layers that choose their own collectives (expert parallelism, ring attention) are not per-op
rules: they call ``find_mesh`` and ``shard_map_all`` themselves.
"""

from .boundary import bypassed, find_mesh, partition_spec, run_sharded, shard_map_all, sharded
from .cases import MeshCase
from .context import CONVENTIONAL_AXES, MeshContext, current_mesh_context, use_mesh
from .rule import Einsum, ShardingError, ShardingRule
from .transport import TRANSPORTS, Transport, default_transport, exchange_rows

__all__ = [
    "CONVENTIONAL_AXES",
    "TRANSPORTS",
    "Einsum",
    "MeshCase",
    "MeshContext",
    "ShardingError",
    "ShardingRule",
    "Transport",
    "bypassed",
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
