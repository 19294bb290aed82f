"""Bad inputs get clear errors; traced group sizes follow the documented reading everywhere."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import moe_gemm_oracle as oracle
import numpy as np
import pytest
import torch

from kernel_hub import get_kernel
from kernel_hub.errors import KernelInputError

moe = get_kernel("moe-gemm")

IMPLEMENTATIONS = ("pallas", "tokamax", "xla", "xla_loop")


def _jax_args(rows=6, k=4, n=5, groups=3, sizes=(2, 1, 3)):
    return jnp.ones((rows, k)), jnp.ones((groups, k, n)), jnp.asarray(sizes, jnp.int32)


BAD_GMM_INPUTS = [
    pytest.param(
        lambda: _jax_args(sizes=(4, 1, 3)), "sum to 8 but lhs has 6 rows", id="sizes-sum-above-m"
    ),
    pytest.param(lambda: _jax_args(sizes=(3, -1, 2)), "must be >= 0; groups [1]", id="negative"),
    pytest.param(
        lambda: (jnp.ones((2, 6, 4)), *_jax_args()[1:]), "lhs must have rank 2", id="lhs-rank"
    ),
    pytest.param(
        lambda: (_jax_args()[0], jnp.ones((4, 5)), _jax_args()[2]),
        "rhs must have rank 3",
        id="rhs-rank",
    ),
    pytest.param(
        lambda: (*_jax_args()[:2], jnp.ones((3, 1), jnp.int32)),
        "group_sizes must have rank 1",
        id="sizes-rank",
    ),
    pytest.param(lambda: (jnp.ones((6, 7)), *_jax_args()[1:]), "has k=7 but rhs", id="k-mismatch"),
    pytest.param(
        lambda: (jnp.ones((6, 4), jnp.int32), *_jax_args()[1:]),
        "lhs has dtype int32; supported: float32, bfloat16, float64",
        id="int-lhs",
    ),
    pytest.param(
        lambda: (jnp.ones((6, 4), jnp.bfloat16), *_jax_args()[1:]),
        "lhs is bfloat16 but rhs is float32",
        id="mixed-dtypes",
    ),
    pytest.param(
        lambda: (*_jax_args()[:2], jnp.asarray([2.0, 1.0, 3.0])),
        "group_sizes has dtype float32",
        id="float-sizes",
    ),
    pytest.param(
        lambda: (*_jax_args()[:2], jnp.asarray([2, 4], jnp.int32)),
        "group_sizes has 2 entries but rhs has 3 groups",
        id="sizes-count",
    ),
]


@pytest.mark.parametrize(("make_args", "message"), BAD_GMM_INPUTS)
def test_jax_gmm_rejects_bad_inputs(make_args, message):
    with pytest.raises(KernelInputError) as info:
        moe.jax.gmm(*make_args())
    assert message in str(info.value)


def test_jax_gmm_rejects_transposed_k_mismatch():
    lhs, rhs, sizes = _jax_args()  # rhs [3, 4, 5] read as [E, n, k] has k=5, lhs has k=4
    with pytest.raises(KernelInputError, match=r"\[E, n, k\] \(transpose_rhs=True\) has k=5"):
        moe.jax.gmm(lhs, rhs, sizes, transpose_rhs=True)


def test_jax_tgmm_rejects_bad_inputs():
    with pytest.raises(KernelInputError, match="need the same number of rows"):
        moe.jax.tgmm(jnp.ones((6, 4)), jnp.ones((5, 3)), jnp.asarray([6], jnp.int32))
    with pytest.raises(KernelInputError, match="sum to 9 but lhs has 6 rows"):
        moe.jax.tgmm(jnp.ones((6, 4)), jnp.ones((6, 3)), jnp.asarray([4, 5], jnp.int32))


def test_bad_preferred_element_type_is_rejected():
    with pytest.raises(KernelInputError, match="preferred_element_type must be one of"):
        moe.jax.gmm(*_jax_args(), preferred_element_type=jnp.int32)


def test_torch_gmm_rejects_bad_inputs():
    lhs, rhs = torch.ones(6, 4), torch.ones(3, 4, 5)
    with pytest.raises(KernelInputError, match="sum to 8 but lhs has 6 rows"):
        moe.gmm(lhs, rhs, torch.tensor([4, 1, 3], dtype=torch.int32))
    with pytest.raises(KernelInputError, match="must be >= 0"):
        moe.gmm(lhs, rhs, torch.tensor([3, -1, 2], dtype=torch.int32))
    with pytest.raises(KernelInputError, match="lhs has dtype int64"):
        moe.gmm(lhs.long(), rhs, torch.tensor([2, 1, 3], dtype=torch.int32))
    with pytest.raises(KernelInputError, match="has k=4 but rhs"):
        moe.gmm(lhs, rhs, torch.tensor([2, 1, 3], dtype=torch.int32), transpose_rhs=True)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_traced_sizes_read_negative_as_zero_and_drop_rows_past_m(implementation):
    """Under jit sizes cannot be checked: every implementation reads them the same way."""
    rng = np.random.default_rng(0)
    lhs = jnp.asarray(rng.standard_normal((10, 4)), jnp.float32)
    rhs = jnp.asarray(rng.standard_normal((4, 4, 3)), jnp.float32)
    gmm = jax.jit(lambda a, b, s: moe.jax.gmm(a, b, s, implementation=implementation))
    out = gmm(lhs, rhs, jnp.asarray([3, -2, 5, 9], jnp.int32))
    # Read as [3, 0, 5, 2]: the last group keeps only the 2 rows that exist.
    oracle.assert_close(out, oracle.gmm(lhs, rhs, [3, 0, 5, 2]), "float32", implementation)


def test_torch_gmm_accepts_int64_group_sizes():
    torch.manual_seed(0)
    lhs, rhs = torch.randn(6, 4), torch.randn(3, 4, 5)
    sizes = torch.tensor([2, 0, 3])  # int64, as torch.bincount gives
    out = moe.gmm(lhs, rhs, sizes)
    expected = torch.cat([lhs[:2] @ rhs[0], lhs[2:5] @ rhs[2], torch.zeros(1, 5)])
    torch.testing.assert_close(out, expected)
