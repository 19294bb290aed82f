"""Fixtures for the attention tests: the installed kernel module, loaded as get_kernel loads it."""

from __future__ import annotations

import pytest

from kernel_hub.loading.loader import load_kernel_dir
from kernel_hub.paths import kernels_dir


@pytest.fixture(scope="session")
def attention():
    return load_kernel_dir(kernels_dir() / "attention")


@pytest.fixture
def pallas_first(attention):
    """Run the Pallas kernel (interpret mode) instead of the CPU default order.

    The order is read when a function is traced, so JAX's caches are cleared on the way in and
    out (a cached trace would keep the previous order). Yields a list that records each trace of
    the Pallas forward, so a test can show the kernel ran.
    """
    import jax

    table = attention.jax.TABLE
    saved = table.order("cpu")
    pallas_tpu = attention.jax.pallas_tpu
    original = pallas_tpu.attention_forward
    traces = []

    def recording(*args, **kwargs):
        traces.append(args[0].shape)
        return original(*args, **kwargs)

    jax.clear_caches()
    table.set_order("cpu", ("pallas", "xla"))
    pallas_tpu.attention_forward = recording
    try:
        yield traces
    finally:
        pallas_tpu.attention_forward = original
        table.set_order("cpu", saved)
        jax.clear_caches()
