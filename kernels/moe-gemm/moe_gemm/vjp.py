"""Differentiation of gmm and tgmm, shared by every implementation.

Each is the other's transpose, so one pair of raw (non-differentiable) kernels gives both
gradients: for ``out = gmm(lhs, rhs)``, ``dlhs = gmm(dout, rhs^T)`` and ``drhs = tgmm(lhs, dout)``
(``tgmm(dout, lhs)`` for [E, n, k] weights); for ``w = tgmm(lhs, grad)``,
``dlhs = gmm(grad, dw^T)`` and ``dgrad = gmm(lhs, dw)``. The backward kernels run with their
implementation's default tiling for their own shapes. XLA's ``ragged_dot`` cannot differentiate
its ragged-contraction form (tgmm) at all, so even the XLA implementation goes through here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax


@dataclass(frozen=True)
class Backend:
    """Raw kernels of one implementation.

    ``gmm(lhs, rhs, group_sizes, *, transpose_rhs, out_dtype, tiling)`` and
    ``tgmm(lhs, grad, group_sizes, *, out_dtype, tiling)``; ``tiling=None`` means the default.
    """

    gmm: Callable[..., jax.Array]
    tgmm: Callable[..., jax.Array]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _gmm(backend: Backend, transpose_rhs: bool, out_dtype: Any, tiling: Any, lhs, rhs, sizes):
    return backend.gmm(
        lhs, rhs, sizes, transpose_rhs=transpose_rhs, out_dtype=out_dtype, tiling=tiling
    )


def _gmm_fwd(backend, transpose_rhs, out_dtype, tiling, lhs, rhs, sizes):
    return _gmm(backend, transpose_rhs, out_dtype, tiling, lhs, rhs, sizes), (lhs, rhs, sizes)


def _gmm_bwd(backend, transpose_rhs, out_dtype, tiling, residuals, dout):
    return (*gmm_backward(backend, *residuals, dout, transpose_rhs=transpose_rhs), None)


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _tgmm(backend: Backend, out_dtype: Any, tiling: Any, lhs, grad, sizes):
    return backend.tgmm(lhs, grad, sizes, out_dtype=out_dtype, tiling=tiling)


def _tgmm_fwd(backend, out_dtype, tiling, lhs, grad, sizes):
    return _tgmm(backend, out_dtype, tiling, lhs, grad, sizes), (lhs, grad, sizes)


def _tgmm_bwd(backend, out_dtype, tiling, residuals, dout):
    return (*tgmm_backward(backend, *residuals, dout), None)


_tgmm.defvjp(_tgmm_fwd, _tgmm_bwd)


def gmm(backend: Backend, lhs, rhs, group_sizes, *, transpose_rhs: bool, out_dtype, tiling):
    """``backend.gmm``, differentiable in ``lhs`` and ``rhs``."""
    return _gmm(backend, transpose_rhs, out_dtype, tiling, lhs, rhs, group_sizes)


def tgmm(backend: Backend, lhs, grad, group_sizes, *, out_dtype, tiling):
    """``backend.tgmm``, differentiable in ``lhs`` and ``grad``."""
    return _tgmm(backend, out_dtype, tiling, lhs, grad, group_sizes)


def gmm_backward(backend: Backend, lhs, rhs, group_sizes, dout, *, transpose_rhs: bool):
    """(dlhs, drhs) of ``gmm`` for the output cotangent ``dout``; the forward is not needed."""
    dout = dout.astype(lhs.dtype)
    dlhs = _gmm(backend, not transpose_rhs, lhs.dtype, None, dout, rhs, group_sizes)
    x, y = (dout, lhs) if transpose_rhs else (lhs, dout)
    drhs = _tgmm(backend, rhs.dtype, None, x, y, group_sizes)
    return dlhs, drhs


def tgmm_backward(backend: Backend, lhs, grad, group_sizes, dout):
    """(dlhs, dgrad) of ``tgmm`` for the output cotangent ``dout`` [E, k, n]."""
    dout = dout.astype(lhs.dtype)
    # d lhs[rows of g] = grad[rows of g] @ dout[g].T ; d grad[rows of g] = lhs[rows of g] @ dout[g]
    dlhs = _gmm(backend, True, lhs.dtype, None, grad, dout, group_sizes)
    dgrad = _gmm(backend, False, grad.dtype, None, lhs, dout, group_sizes)
    return dlhs, dgrad
