"""Plain JAX grouped matmuls (``jax.lax.ragged_dot_general``): the XLA implementation.

Accumulation is in f32 (f64 for f64 inputs), rounded once to the output dtype. Rows past the
last group give zeros in ``gmm``; groups without rows give zeros in ``tgmm``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# gmm: lhs [m, k] x rhs [E, k, n] -> [m, n]
GMM_DIMS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [1]), ([], [])),
    lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0],
)
# gmm with transposed weights: lhs [m, k] x rhs [E, n, k] -> [m, n]
GMM_TRANSPOSED_DIMS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])),
    lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0],
)
# tgmm: lhs [m, k] x grad [m, n] -> [E, k, n], contracting the ragged rows group by group
TGMM_DIMS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([0], [0]), ([], [])),
    lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[],
)


def accumulator_dtype(dtype) -> jnp.dtype:
    """f32, or f64 for f64 inputs; every implementation accumulates in it."""
    return jnp.promote_types(dtype, jnp.float32)


def gmm_dims(transpose_rhs: bool) -> jax.lax.RaggedDotDimensionNumbers:
    return GMM_TRANSPOSED_DIMS if transpose_rhs else GMM_DIMS


def gmm(lhs, rhs, group_sizes, *, transpose_rhs: bool, out_dtype) -> jax.Array:
    """``out[rows of g] = lhs[rows of g] @ rhs[g]`` (``rhs[g].T`` if ``transpose_rhs``)."""
    out = jax.lax.ragged_dot_general(
        lhs,
        rhs,
        group_sizes,
        gmm_dims(transpose_rhs),
        precision=jax.lax.Precision.HIGHEST,
        preferred_element_type=accumulator_dtype(lhs.dtype),
    )
    return out.astype(out_dtype)


def tgmm(lhs, grad, group_sizes, *, out_dtype) -> jax.Array:
    """``out[g] = lhs[rows of g].T @ grad[rows of g]`` -> [E, k, n]."""
    out = jax.lax.ragged_dot_general(
        lhs,
        grad,
        group_sizes,
        TGMM_DIMS,
        precision=jax.lax.Precision.HIGHEST,
        preferred_element_type=accumulator_dtype(lhs.dtype),
    )
    return out.astype(out_dtype)
