"""The Pallas kernel, compiled for real TPU generations without a TPU, reads the weight and its
scales in place (no copy, transpose or dequantized temporary of the weight in the program), and
its declared decode traffic is within 1.15x of the hand-count bound."""

from __future__ import annotations

import re

import jax
import pytest
from jax.sharding import SingleDeviceSharding

from kernel_hub import get_kernel
from kernel_hub.topologies import tpu_device

qmm = get_kernel("quantized-matmul")
pytestmark = [pytest.mark.tpu_compile, pytest.mark.slow]
CASES = {case.name: case for case in qmm.benchmark.CASES}


def _compiled(case, generation):
    device = tpu_device(generation)
    placed = [
        jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=SingleDeviceSharding(device))
        for a in case.args
    ]
    with jax.default_device(device):
        fn = jax.jit(lambda *args: case.fn(*args, implementation="pallas"))
        return fn.trace(*placed).lower().compile()


@pytest.mark.parametrize("generation", ["v5e", "v6e"])
@pytest.mark.parametrize(
    "name",
    [
        "llama3-8b-down_proj-fp8-decode256",
        "llama3-8b-q_proj-int8-decode64",
        "llama3-8b-down_proj-int4z-decode64",  # packed weight, scales and zero points
    ],
)
def test_decode_reads_weights_in_place_near_the_bound(generation, name):
    case = CASES[name]
    compiled = _compiled(case, generation)
    text = compiled.as_text()
    weight = case.args[1]
    # only the kernel touches the weight (and int4's zero points): no copy, transpose, convert
    # or fusion of them
    shapes = {re.escape(f"[{','.join(map(str, a.shape))}]") for a in (weight, *case.args[3:])}
    touching = [
        line.strip()
        for line in text.splitlines()
        for shape in shapes
        if re.search(rf"= \w+{shape}", line) and "parameter(" not in line
    ]
    assert not touching, touching
    assert compiled.memory_analysis().temp_size_in_bytes < weight.size // 100
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    assert cost["bytes accessed"] <= 1.15 * case.bytes_accessed
