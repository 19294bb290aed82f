"""Independent numerics oracle for the grouped matmuls: a float64 numpy loop over groups."""

from __future__ import annotations

import numpy as np

# Largest allowed error relative to the largest reference magnitude, per input dtype.
RTOL = {"float32": 1e-5, "bfloat16": 1e-2, "float64": 1e-12}


def as_f64(x) -> np.ndarray:
    """numpy/JAX arrays (bf16 included) as float64."""
    return np.asarray(x).astype(np.float64)


def group_rows(sizes, rows: int):
    """(group, start, end) of each group's rows, sizes read as given (checked elsewhere)."""
    start = 0
    for group, size in enumerate(sizes):
        yield group, start, min(start + int(size), rows)
        start += int(size)


def gmm(lhs, rhs, sizes, transpose_rhs: bool = False) -> np.ndarray:
    lhs, rhs = as_f64(lhs), as_f64(rhs)
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    out = np.zeros((lhs.shape[0], n))
    for group, start, end in group_rows(sizes, lhs.shape[0]):
        weight = rhs[group].T if transpose_rhs else rhs[group]
        out[start:end] = lhs[start:end] @ weight
    return out


def tgmm(lhs, grad, sizes) -> np.ndarray:
    lhs, grad = as_f64(lhs), as_f64(grad)
    out = np.zeros((len(sizes), lhs.shape[1], grad.shape[1]))
    for group, start, end in group_rows(sizes, lhs.shape[0]):
        out[group] = lhs[start:end].T @ grad[start:end]
    return out


def errors(actual, expected) -> tuple[float, float]:
    """(max abs error, max abs error relative to the largest expected magnitude)."""
    actual, expected = as_f64(actual), np.asarray(expected, np.float64)
    abs_err = float(np.max(np.abs(actual - expected), initial=0.0))
    scale = float(np.max(np.abs(expected), initial=0.0))
    return abs_err, abs_err / scale if scale else abs_err


def assert_close(actual, expected, dtype_name: str, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    abs_err, rel_err = errors(actual, expected)
    rtol = RTOL[dtype_name]
    assert rel_err <= rtol, (
        f"{what}: max abs error {abs_err:.3g}, max rel error {rel_err:.3g} > {rtol:g}"
    )


def dequantize(weight, scale, fmt: str) -> np.ndarray:
    """float64 [E, out, in] of an int8 (scale [E, out]) or fp8 (scale [E, out/128, in/128])
    weight: ``weight * scale`` of its channel or 128x128 block."""
    w, s = as_f64(weight), as_f64(scale)
    if fmt == "int8":
        return w * s[:, :, None]
    return w * np.repeat(np.repeat(s, 128, axis=1), 128, axis=2)[:, : w.shape[1], : w.shape[2]]
