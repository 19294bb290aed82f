"""Every torch op's schema, as recorded in ``op_schemas.txt`` (one ``kernel op(schema)`` a line,
backward ops included): a change to one (a parameter renamed, reordered or retyped, a default
changed, an op added or removed) fails here, so it is deliberate. New parameters go last, so
positional calls written against an earlier schema keep their meaning; update the record in the
same commit.

The record was taken from the hand-written ``torch_ops.py`` stubs before the torch ops were
derived from the kernels' JAX declarations (``kernel_api.op``): the derived ops keep it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kernel_hub import get_kernel
from kernel_hub.registry.registry import load_registry
from kernel_hub.testing import kernel_ops

KERNELS = sorted({entry.kernel: op for op, entry in load_registry().ops.items()}.items())


def _recorded() -> dict[str, dict[str, str]]:
    """kernel -> op name -> schema (the ``torch.library`` schema less the qualified name)."""
    record: dict[str, dict[str, str]] = {}
    for line in (Path(__file__).parent / "op_schemas.txt").read_text().splitlines():
        kernel, _, schema = line.partition(" ")
        name, _, rest = schema.partition("(")
        record.setdefault(kernel, {})[name] = "(" + rest
    return record


def _schemas(kernel_module) -> dict[str, str]:
    """The schema of every torch op (and backward op) the kernel's loaded modules define."""
    found = {}
    for value in kernel_ops(kernel_module).values():
        for op in (value.op, value.backward_op):
            if op is not None:
                qualified, _, rest = str(op._schema).partition("(")
                found[qualified.split("::")[1]] = "(" + rest
    return found


@pytest.mark.parametrize(("kernel", "op"), KERNELS, ids=[k for k, _ in KERNELS])
def test_torch_op_schemas_are_as_recorded(kernel: str, op: str) -> None:
    found = _schemas(get_kernel(op))
    assert found == _recorded().get(kernel), f"{kernel}: schemas differ from op_schemas.txt"
