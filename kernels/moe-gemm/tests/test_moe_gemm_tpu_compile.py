"""On a TPU (a deviceless topology), the dispatch says why it skips an implementation.

The registry's compile matrix (tests/bench/test_compile_matrix.py) compiles the Pallas kernels
at every benchmark case for every generation, forward and backward.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from kernel_hub import get_kernel
from kernel_hub.errors import NoImplementationError
from kernel_hub.topologies import tpu_device

moe = get_kernel("moe-gemm")

pytestmark = [pytest.mark.tpu_compile, pytest.mark.slow]


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
