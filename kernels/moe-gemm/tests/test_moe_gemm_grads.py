"""Gradients of gmm / tgmm: JAX VJPs against the float64 oracle, and torch gradcheck / opcheck
through the torch ops."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import moe_gemm_oracle as oracle
import numpy as np
import pytest
import torch

from kernel_hub import get_kernel

moe = get_kernel("moe-gemm")

IMPLEMENTATIONS = ("pallas", "tokamax", "xla", "xla_loop")
SIZES = [4, 0, 9, 2]  # 15 of 17 rows: an empty group and rows past the sum
ROWS, K, N = 17, 8, 12


def _arrays(seed: int, *shapes, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.standard_normal(shape), dtype) for shape in shapes]


def _weights(rhs, transpose_rhs: bool) -> np.ndarray:
    rhs = oracle.as_f64(rhs)
    return np.swapaxes(rhs, 1, 2) if transpose_rhs else rhs  # [E, k, n]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_gmm_vjp_matches_oracle(implementation, transpose_rhs):
    rhs_shape = (len(SIZES), N, K) if transpose_rhs else (len(SIZES), K, N)
    lhs, rhs, cot = _arrays(0, (ROWS, K), rhs_shape, (ROWS, N))
    gs = jnp.asarray(SIZES, jnp.int32)

    def f(a, b):
        return moe.jax.gmm(a, b, gs, transpose_rhs=transpose_rhs, implementation=implementation)

    _, pullback = jax.vjp(jax.jit(f), lhs, rhs)
    dlhs, drhs = pullback(cot)

    weights = _weights(rhs, transpose_rhs)
    expected_dlhs = oracle.gmm(cot, np.swapaxes(weights, 1, 2), SIZES)
    expected_dw = oracle.tgmm(lhs, cot, SIZES)  # [E, k, n]
    expected_drhs = np.swapaxes(expected_dw, 1, 2) if transpose_rhs else expected_dw
    oracle.assert_close(dlhs, expected_dlhs, "float32", f"dlhs[{implementation}]")
    oracle.assert_close(drhs, expected_drhs, "float32", f"drhs[{implementation}]")


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_tgmm_vjp_matches_oracle(implementation):
    lhs, grad, cot = _arrays(1, (ROWS, K), (ROWS, N), (len(SIZES), K, N))
    gs = jnp.asarray(SIZES, jnp.int32)

    def f(a, b):
        return moe.jax.tgmm(a, b, gs, implementation=implementation)

    _, pullback = jax.vjp(jax.jit(f), lhs, grad)
    dlhs, dgrad = pullback(cot)
    # d lhs[rows of g] = grad[rows of g] @ c[g].T ; d grad[rows of g] = lhs[rows of g] @ c[g]
    oracle.assert_close(dlhs, oracle.gmm(grad, cot, SIZES, transpose_rhs=True), "float32", "dlhs")
    oracle.assert_close(dgrad, oracle.gmm(lhs, cot, SIZES), "float32", "dgrad")


@pytest.mark.parametrize("implementation", ["pallas", "xla", "xla_loop"])
@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_torch_gmm_gradcheck_f64(implementation, transpose_rhs):
    torch.manual_seed(0)
    sizes = torch.tensor([2, 0, 3], dtype=torch.int32)
    lhs = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    shape = (3, 5, 4) if transpose_rhs else (3, 4, 5)
    rhs = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda a, b: moe.gmm(a, b, sizes, transpose_rhs, None, implementation), (lhs, rhs)
    )


@pytest.mark.parametrize("implementation", ["pallas", "xla", "xla_loop"])
def test_torch_tgmm_gradcheck_f64(implementation):
    torch.manual_seed(1)
    sizes = torch.tensor([3, 0, 2], dtype=torch.int32)
    lhs = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda a, b: moe.tgmm(a, b, sizes, None, implementation), (lhs, grad)
    )


def test_torch_ops_pass_opcheck():
    torch.manual_seed(2)
    sizes = torch.tensor([3, 1, 0, 2], dtype=torch.int32)
    lhs = torch.randn(7, 8, requires_grad=True)
    rhs = torch.randn(4, 16, 8, requires_grad=True)
    torch.library.opcheck(moe.gmm.op, (lhs, rhs, sizes), {"transpose_rhs": True})
    grad = torch.randn(7, 16, requires_grad=True)
    torch.library.opcheck(moe.tgmm.op, (lhs, grad, sizes))
