"""The Pallas kernels compile for real TPU generations, forward and backward, without a TPU.

libtpu's deviceless topologies run the Mosaic compiler as on a TPU host, so block-shape and
VMEM mistakes for a generation fail here. Compile times are printed and recorded as test
properties (``--junitxml``).
"""

from __future__ import annotations

import functools
import os
import time

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import SingleDeviceSharding

from kernel_hub.errors import NoImplementationError

pytestmark = [pytest.mark.tpu_compile, pytest.mark.slow]

TOPOLOGIES = {"v4": "v4:2x2x1", "v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2"}
# One benchmark case per generation, spread over models, projections and phases.
CASE_PER_GENERATION = {
    "v4": "mixtral-8x7b-gate_up-prefill8192",  # v4 has the smallest scoped VMEM (16 MiB)
    "v5e": "fine-grained-e64-down-decode16",
    "v5p": "mixtral-8x7b-down-decode1",
    "v6e": "fine-grained-e64-gate_up-prefill8192",
}


@functools.cache
def tpu_device(generation: str):
    # Deviceless compiles use no TPU, so libtpu's one-process-per-host lock guards nothing here;
    # without this, any other process holding libtpu (a parallel test run) aborts the topology.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    return topologies.get_topology_desc(TOPOLOGIES[generation], "tpu").devices[0]


def _placed(tree, device):
    sharding = SingleDeviceSharding(device)
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), tree)


def _forward_and_backward(case):
    forward = functools.partial(case.fn, **case.kwargs, implementation="pallas")

    def backward(lhs, rhs, group_sizes, cotangent):
        _, pullback = jax.vjp(lambda a, b: forward(a, b, group_sizes), lhs, rhs)
        return pullback(cotangent)

    cotangent = jax.eval_shape(forward, *case.args)
    return {"forward": (forward, case.args), "backward": (backward, (*case.args, cotangent))}


@pytest.mark.parametrize("generation", list(TOPOLOGIES))
def test_pallas_compiles_for_generation(moe, generation, record_property):
    case = next(c for c in moe.benchmark.CASES if c.name == CASE_PER_GENERATION[generation])
    device = tpu_device(generation)
    for direction, (fn, args) in _forward_and_backward(case).items():
        start = time.perf_counter()
        with jax.default_device(device):
            lowered = jax.jit(fn).trace(*_placed(args, device)).lower()
            lowered.compile()
        seconds = time.perf_counter() - start
        assert "tpu_custom_call" in lowered.as_text(), "the Mosaic kernel is not in the program"
        record_property(f"{direction}_compile_seconds", round(seconds, 2))
        print(f"{generation} {case.name} {direction}: compiled in {seconds:.2f} s")


def test_tpu_dispatch_explains_why_implementations_are_skipped(moe):
    """On TPU: tokamax's Mosaic kernel refuses dimensions below 128, pallas refuses f64."""
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
