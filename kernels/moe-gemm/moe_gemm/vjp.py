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
    lhs, rhs, sizes = residuals
    dout = dout.astype(lhs.dtype)
    dlhs = _gmm(backend, not transpose_rhs, lhs.dtype, None, dout, rhs, sizes)
    x, y = (dout, lhs) if transpose_rhs else (lhs, dout)
    drhs = _tgmm(backend, rhs.dtype, None, x, y, sizes)
    return dlhs, drhs, None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _tgmm(backend: Backend, out_dtype: Any, tiling: Any, lhs, grad, sizes):
    return backend.tgmm(lhs, grad, sizes, out_dtype=out_dtype, tiling=tiling)


def _tgmm_fwd(backend, out_dtype, tiling, lhs, grad, sizes):
    return _tgmm(backend, out_dtype, tiling, lhs, grad, sizes), (lhs, grad, sizes)


def _tgmm_bwd(backend, out_dtype, tiling, residuals, dout):
    lhs, grad, sizes = residuals
    dout = dout.astype(lhs.dtype)
    dlhs = _gmm(backend, True, lhs.dtype, None, grad, dout, sizes)
    dgrad = _gmm(backend, False, grad.dtype, None, lhs, dout, sizes)
    return dlhs, dgrad, None


_tgmm.defvjp(_tgmm_fwd, _tgmm_bwd)


def gmm(backend: Backend, lhs, rhs, group_sizes, *, transpose_rhs: bool, out_dtype, tiling):
    """``backend.gmm``, differentiable in ``lhs`` and ``rhs``."""
    return _gmm(backend, transpose_rhs, out_dtype, tiling, lhs, rhs, group_sizes)


def tgmm(backend: Backend, lhs, grad, group_sizes, *, out_dtype, tiling):
    """``backend.tgmm``, differentiable in ``lhs`` and ``grad``."""
    return _tgmm(backend, out_dtype, tiling, lhs, grad, group_sizes)
