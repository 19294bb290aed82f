"""Fixtures for the ragged-attention tests: the installed kernel, loaded as get_kernel loads it,
and a recorder of which Pallas kernel ran on which K/V dtype (the model tests)."""

from __future__ import annotations

import pytest

from kernel_hub.loading.loader import load_kernel_dir
from kernel_hub.paths import kernels_dir


@pytest.fixture(scope="session")
def ragged():
    return load_kernel_dir(kernels_dir() / "ragged-attention")


class PallasTraces(dict):
    """{"ragged": [...], "paged": [...]}: the query shape of each trace of each Pallas kernel."""

    def __init__(self, tables):
        super().__init__(ragged=[], paged=[], key_dtypes={"ragged": set(), "paged": set()})
        self.tables = tables

    def prefer_pallas(self) -> None:
        """Put Pallas first on CPU; after kernelize, which applies the registry's order."""
        import jax

        jax.clear_caches()
        for table in self.tables:
            table.set_order("cpu", ("pallas", "xla"))


@pytest.fixture
def pallas_traces(ragged):
    """Records the Pallas kernels' traces; restores the implementation order afterwards."""
    import jax

    api = ragged.jax
    tables = (api.RAGGED_TABLE, api.PAGED_TABLE)
    saved = [t.order("cpu") for t in tables]
    traces = PallasTraces(tables)
    originals = (api.pallas_ragged.ragged_attention, api.pallas_paged.paged_attention)

    def recording(kind, original):
        def record(*args, **kwargs):
            traces[kind].append(tuple(args[0].shape))
            traces["key_dtypes"][kind].add(args[1].dtype.name)  # keys or pages it reads
            return original(*args, **kwargs)

        return record

    api.pallas_ragged.ragged_attention = recording("ragged", originals[0])
    api.pallas_paged.paged_attention = recording("paged", originals[1])
    try:
        yield traces
    finally:
        api.pallas_ragged.ragged_attention, api.pallas_paged.paged_attention = originals
        for table, order in zip(tables, saved, strict=True):
            table.set_order("cpu", order)
        jax.clear_caches()
