"""Option dataclasses (``kernel_hub.options``): parameter lists derived from one declaration, and
``SavedBackward``'s by-name check in ``jax_op``."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import jax.numpy as jnp
import pytest
import torch

from kernel_hub.kernel_api import (
    SavedBackward,
    jax_op,
    option_values,
    takes_options,
)

NS = "kernel_hub_options_test"


@dataclass(frozen=True)
class Options:
    causal: bool = False
    scale: float | None = None
    block: int | None = None


@dataclass(frozen=True)
class Grown(Options):
    """``Options`` with a field added later (declared last)."""

    offset: float = 0.0


def test_takes_options_derives_keyword_parameters_and_passes_one_instance():
    seen = []

    @takes_options(Options, exclude=("block",))
    def fn(x, y=None, *, options: Options):
        seen.append(options)
        return x

    params = inspect.signature(fn).parameters
    assert list(params) == ["x", "y", "causal", "scale"]
    assert params["scale"].kind is inspect.Parameter.KEYWORD_ONLY
    assert params["scale"].annotation == float | None and params["causal"].default is False
    assert fn(1, causal=True) == 1 and seen[-1] == Options(causal=True)
    assert option_values(seen[-1], exclude=("block",)) == {"causal": True, "scale": None}
    with pytest.raises(TypeError, match="block"):
        fn(1, block=8)  # excluded: not a keyword of fn


def test_bad_declarations_are_refused():
    with pytest.raises(TypeError, match=r"has no fields \['bogus'\]"):
        takes_options(Options, exclude=("bogus",))
    with pytest.raises(TypeError, match="last parameter must be 'options'"):
        takes_options(Options)(lambda x, y: x)


def _forward(x, w, *, scale):
    return x * w * scale


def _backward(x, w, out, d_out, *, scale):
    return d_out * w * scale, jnp.sum(d_out * x * scale, axis=0)


def test_saved_backward_is_used_and_checked_by_name():
    @jax_op(
        NS,
        _forward,
        differentiable=("x", "w"),
        jax_backward=SavedBackward(_backward, ("out", "d_out")),
    )
    def scaled(x: torch.Tensor, w: torch.Tensor, scale: float = 1.0) -> torch.Tensor: ...

    x = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(4, requires_grad=True)
    scaled(x, w, 2.0).sum().backward()
    torch.testing.assert_close(x.grad, (w * 2.0).expand(3, 4).detach())
    torch.testing.assert_close(w.grad, x.detach().sum(0) * 2.0)

    with pytest.raises(TypeError, match=r"JAX backward disagree: .*\(x, w, out, d_out\)"):

        @jax_op(NS, _forward, jax_backward=SavedBackward(_backward, ("d_out", "out")))
        def misnamed(x: torch.Tensor, w: torch.Tensor, scale: float = 1.0) -> torch.Tensor: ...


@dataclass(frozen=True)
class Scores:
    causal: bool = False
    sliding_window: int | None = None
    softcap: float | None = None
    scale: float | None = None


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"sliding_window": 0}, "k: sliding_window=0; it must be an integer >= 1 (keys with"),
        ({"sliding_window": 2.0}, "k: sliding_window=2.0; it must be an integer >= 1"),
        ({"sliding_window": True}, "k: sliding_window=True; it must be an integer >= 1"),
        ({"softcap": 0.0}, "k: softcap=0.0; it must be a finite number > 0 or None"),
        ({"softcap": float("inf")}, "k: softcap=inf; it must be a finite number > 0 or None"),
        ({"scale": float("nan")}, "k: scale=nan; it must be finite or None"),
        # the first bad option is named
        ({"sliding_window": -1, "scale": float("nan")}, "k: sliding_window=-1"),
    ],
)
def test_score_option_values_are_checked(values, message):
    from kernel_hub.errors import KernelInputError
    from kernel_hub.kernel_api import check_score_options

    with pytest.raises(KernelInputError) as info:
        check_score_options(Scores(**values), "k")
    assert str(info.value).startswith(message)
    check_score_options(Scores(sliding_window=1, softcap=0.5, scale=-2.0), "k")
    check_score_options(Scores(), "k")


def test_resolved_scores_fill_the_scale_and_make_numbers_floats():
    from kernel_hub.kernel_api import resolved_scores

    assert resolved_scores(Scores(), 16) == {"causal": False, "softcap": None, "scale": 0.25}
    resolved = resolved_scores(Scores(causal=1, softcap=30, scale=2), 16)
    assert resolved == {"causal": True, "softcap": 30.0, "scale": 2.0}
    assert [type(v) for v in resolved.values()] == [bool, float, float]
