"""A bridged op checks each argument against its stub's annotation before the stub's own checks
or any JAX tracing: a wrong type is a KernelInputError naming the argument and what is valid."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernel_hub.bridge.torch_op import jax_op
from kernel_hub.errors import KernelInputError

NS = "kernel_hub_test_argument_types"


def _affine(x, bias, scale, repeats, mode):
    out = x * scale * repeats
    return out if bias is None else out + bias


@jax_op(NS, _affine)
def affine(
    x: torch.Tensor,
    bias: torch.Tensor | None = None,
    scale: float = 1.0,
    repeats: int = 1,
    mode: str | None = None,
) -> torch.Tensor:
    """x * scale * repeats (+ bias)."""


X = torch.ones(2, 4)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, 1.0),
        ({"bias": torch.ones(4)}, 2.0),  # optional tensor given
        ({"scale": 2}, 2.0),  # an int is a float
        ({"scale": np.float32(0.5)}, 0.5),  # numpy scalars are numbers
        ({"repeats": np.int64(3)}, 3.0),
        ({"mode": "any"}, 1.0),
    ],
)
def test_accepted(kwargs: dict, expected: float) -> None:
    torch.testing.assert_close(affine(X, **kwargs), torch.full((2, 4), expected))


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ((None,), {}, "affine: x must be a tensor, got NoneType None"),
        ((X,), {"bias": 1.0}, "affine: bias must be a tensor or None, got float 1.0"),
        ((X,), {"scale": "2"}, "affine: scale must be a float, got str '2'"),
        ((X,), {"repeats": 2.5}, "affine: repeats must be an int, got float 2.5"),
        ((X,), {"mode": 3}, "affine: mode must be a str or None, got int 3"),
    ],
)
def test_refused_with_what_is_valid(args: tuple, kwargs: dict, message: str) -> None:
    with pytest.raises(KernelInputError, match=message):
        affine(*args, **kwargs)


def test_checked_after_a_cached_call_with_an_equal_value() -> None:
    """``2.0 == 2`` but an int parameter refuses it, also after a call with 2 was cached."""
    for _ in range(2):
        torch.testing.assert_close(affine(X, repeats=2), torch.full((2, 4), 2.0))
    with pytest.raises(KernelInputError, match=r"repeats must be an int, got float 2\.0"):
        affine(X, repeats=2.0)


def test_checked_under_torch_compile_too() -> None:
    compiled = torch.compile(lambda x: affine(x, scale=3.0), fullgraph=True)
    torch.testing.assert_close(compiled(X), torch.full((2, 4), 3.0))
