"""The Pallas kernels compile for real TPU generations, forward and backward, without a TPU.

libtpu's deviceless topologies run the Mosaic compiler as on a TPU host, so block-shape and
VMEM mistakes for a generation fail here. Compile times are printed and recorded as test
properties (``--junitxml``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from kernel_hub import get_kernel
from kernel_hub.bench.compile_check import compile_case
from kernel_hub.errors import NoImplementationError
from kernel_hub.topologies import DEFAULT_GENERATIONS, tpu_device

moe = get_kernel("moe-gemm")

pytestmark = [pytest.mark.tpu_compile, pytest.mark.slow]

# One benchmark case per generation, spread over models, projections and phases.
CASE_PER_GENERATION = {
    "v4": "mixtral-8x7b-gate_up-prefill8192",  # v4 has the smallest scoped VMEM (16 MiB)
    "v5e": "fine-grained-e64-down-decode256",
    "v5p": "mixtral-8x7b-down-decode1",
    "v6e": "fine-grained-e64-gate_up-prefill8192",
}


@pytest.mark.parametrize("generation", DEFAULT_GENERATIONS)
@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_pallas_compiles_for_generation(generation, direction, record_property):
    case = next(c for c in moe.benchmark.CASES if c.name == CASE_PER_GENERATION[generation])
    result = compile_case("moe-gemm", case, generation, direction, implementation="pallas")
    assert result.ok, f"{generation} {case.name} {direction}: {result.error}"
    record_property("compile_seconds", round(result.seconds, 2))
    print(f"{generation} {case.name} {direction}: compiled in {result.seconds:.2f} s")


def test_tpu_dispatch_explains_why_implementations_are_skipped():
    """On TPU: tokamax's Mosaic kernel refuses dimensions below 128 and TPU v4, pallas f64."""
    decode = jax.ShapeDtypeStruct((2, 4096), jnp.bfloat16)
    weights = jax.ShapeDtypeStruct((8, 28672, 4096), jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((8,), jnp.int32)
    kwargs = {"transpose_rhs": True, "out_dtype": jnp.bfloat16, "tiling": None}
    with jax.default_device(tpu_device("v5e")):
        verdicts = dict(moe.jax.GMM_TABLE.explain(decode, weights, sizes, **kwargs))
        assert verdicts["pallas"] is None
        assert "needs every dimension >= 128" in verdicts["tokamax"]
        f64 = jax.ShapeDtypeStruct((2, 4096), jnp.float64)
        with pytest.raises(NoImplementationError, match="float64 runs only in interpret mode"):
            moe.jax.GMM_TABLE.select(f64, weights, sizes, **kwargs, implementation="pallas")
    prefill = jax.ShapeDtypeStruct((16384, 4096), jnp.bfloat16)
    with jax.default_device(tpu_device("v4")):
        verdicts = dict(moe.jax.GMM_TABLE.explain(prefill, weights, sizes, **kwargs))
        assert "needs TPU v5 or newer, this is v4" in verdicts["tokamax"]
        assert verdicts["pallas"] is None
