"""Every op a registry kernel declares has a sharding rule: each torch op the kernel defines
(every ``JaxOp`` in its modules) runs a JAX function ``sharded`` gave a rule (``rule_of``),
which is what lets it run sharded (shard_map on JAX meshes, DTensor strategies on torch
meshes). A new kernel without rules fails here; see ``kernel_hub.sharding`` for how to write one."""

from __future__ import annotations

import pytest

from kernel_hub import get_kernel
from kernel_hub.registry.registry import load_registry
from kernel_hub.sharding.boundary import rule_of
from kernel_hub.testing import kernel_ops

KERNELS = sorted({entry.kernel: name for name, entry in load_registry().ops.items()}.items())
LAYERS = {"moe_ep_swiglu": "expert parallelism: a layer that is its own shard_map over 'ep'"}
"""Ops that are whole sharded layers (they choose their own collectives), not per-shard kernels."""
NO_RULE_YET: dict[str, str] = {}
"""Ops known to lack a rule of their own, with the reason; a rule added for one fails the test
until it is dropped from here."""


@pytest.mark.parametrize(("kernel", "op"), KERNELS, ids=[k for k, _ in KERNELS])
def test_every_op_has_a_sharding_rule(kernel: str, op: str) -> None:
    module = get_kernel(op)
    ops = kernel_ops(module)
    assert ops, f"{kernel}: no torch ops found"
    missing = [
        name
        for name, jax_op in ops.items()
        if rule_of(jax_op.jax_fn) is None and name not in {**NO_RULE_YET, **LAYERS}
    ]
    assert not missing, (
        f"{kernel}: ops {missing} have no sharding rule; decorate their JAX functions with "
        f"kernel_api.sharded(ShardingRule.parse(...)) (see kernel_hub.sharding)"
    )
    unused = [name for name in NO_RULE_YET if name in ops and rule_of(ops[name].jax_fn) is not None]
    assert not unused, f"{unused} have a rule now: drop them from NO_RULE_YET"
