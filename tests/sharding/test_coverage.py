"""Every op a registry kernel declares has a sharding rule: each torch op the kernel defines
(every ``JaxOp`` in its modules) runs a JAX function ``sharded`` gave a rule (``rule_of``),
which is what lets it run sharded (shard_map on JAX meshes, DTensor strategies on torch
meshes). A new kernel without rules fails here; see ``kernel_hub.sharding`` for how to write one."""

from __future__ import annotations

import sys

import pytest

from kernel_hub import get_kernel
from kernel_hub.bridge.torch_op import JaxOp
from kernel_hub.registry.registry import load_registry
from kernel_hub.sharding.boundary import rule_of

KERNELS = sorted({entry.kernel: name for name, entry in load_registry().ops.items()}.items())
LAYERS = {"moe_ep_swiglu": "expert parallelism: a layer that is its own shard_map over 'ep'"}
"""Ops that are whole sharded layers (they choose their own collectives), not per-shard kernels."""
NO_RULE_YET: dict[str, str] = {}
"""Ops known to lack a rule of their own, with the reason; a rule added for one fails the test
until it is dropped from here."""


def _jax_ops(kernel_module) -> dict[str, JaxOp]:
    """Every JaxOp defined in the kernel package's loaded modules, by op name."""
    prefix = kernel_module.__name__ + "."
    found = {}
    for name, module in list(sys.modules.items()):
        if module is None or not (name == kernel_module.__name__ or name.startswith(prefix)):
            continue
        for value in vars(module).values():
            if isinstance(value, JaxOp):
                found[value.qualname.split("::")[1]] = value
    return found


@pytest.mark.parametrize(("kernel", "op"), KERNELS, ids=[k for k, _ in KERNELS])
def test_every_op_has_a_sharding_rule(kernel: str, op: str) -> None:
    module = get_kernel(op)
    ops = _jax_ops(module)
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
