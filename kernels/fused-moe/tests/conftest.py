"""Shared fixture: which implementation of the fused op the model tests run on CPU."""

from __future__ import annotations

import pytest

from kernel_hub import get_kernel

fused = get_kernel("fused-moe")


@pytest.fixture(params=["xla", "pallas"])
def implementation(request):
    """The fused op's implementation on CPU for the test (Pallas runs in interpret mode);
    records which implementation each trace selected."""
    import jax

    table = fused.KERNEL.implementation_tables[0]
    saved = table.order("cpu")
    chosen = []
    original = table.select

    def recording(*args, **kwargs):
        selected = original(*args, **kwargs)
        chosen.append(selected.name)
        return selected

    def use():
        """Put the implementation first: after kernelize, which applies the registry's order."""
        table.set_order("cpu", (request.param,))
        jax.clear_caches()

    table.select = recording
    try:
        yield request.param, chosen, use
    finally:
        del table.select
        table.set_order("cpu", saved)
        jax.clear_caches()
