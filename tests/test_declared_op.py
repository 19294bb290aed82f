"""``kernel_api.op``: one typed JAX declaration gives the checked, sharded JAX function and the
torch op, whose schema follows the JAX signature (a new option is its last parameter and reaches
the sharding rule)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
import torch

from kernel_hub.errors import KernelInputError
from kernel_hub.kernel_api import Einsum, op, require
from kernel_hub.sharding.boundary import choose_rule, rule_of


def _check(x, weight) -> None:
    require(
        weight is None or tuple(weight.shape) == (x.shape[-1],),
        "declared_scale: weight must have shape (x.shape[-1],)",
    )


def _rule(trial: bool = False, **options) -> Einsum:
    return Einsum("... w, w -> ... w", whole=("w",) if trial else ())


@op(check=_check, differentiable=("x", "weight"), sharding=_rule, jax_only=("block",))
def declared_scale(
    x: jax.Array,
    weight: jax.Array | None = None,
    *,
    implementation: str | None = None,
    block: int | None = None,
    trial: bool = False,
) -> jax.Array:
    """``x * weight`` (``x`` when weight is None)."""
    return x if weight is None else x * weight


def test_the_torch_schema_is_the_jax_signature_less_jax_only_options():
    schema = str(declared_scale.torch.op._schema).partition("(")[2]
    assert (
        schema
        == "Tensor x, Tensor? weight=None, str? implementation=None, bool trial=False) -> Tensor"
    )


def test_torch_after_keeps_published_positions_of_options():
    @op(name="declared_after", torch_after={"x": ("trial",)}, jax_only=("block",))
    def declared_after(
        x: jax.Array,
        weight: jax.Array | None = None,
        *,
        block: int | None = None,
        trial: bool = False,
    ) -> jax.Array:
        return x

    schema = str(declared_after.torch.op._schema).partition("(")[2]
    assert schema == "Tensor x, bool trial=False, Tensor? weight=None) -> Tensor"


def test_the_check_runs_for_jax_and_torch_callers():
    for call, array in ((declared_scale, jnp.ones), (declared_scale.torch, torch.ones)):
        with pytest.raises(KernelInputError, match=r"weight must have shape"):
            call(array((2, 4)), array((3,)))


def test_options_reach_the_sharding_rule_named_after_the_op():
    rule = choose_rule(rule_of(declared_scale), {"trial": True}, (2, 1))
    assert rule.op == "declared_scale" and rule.whole == {"w"}
    assert not choose_rule(rule_of(declared_scale), {}, (2, 1)).whole


@pytest.mark.parametrize(
    ("options", "signature", "message"),
    [
        ({"jax_only": ("x",)}, "x: jax.Array", "jax_only parameter x needs a default"),
        ({"torch_required": ("x",)}, "x: jax.Array", "torch_required names x, not an optional"),
        ({"jax_only": ("y",)}, "x: jax.Array", r"name no parameter: \['y'\]"),
        ({"torch_after": {"x": ("y",)}}, "x: jax.Array", r"torch_after names no torch .*\['y'\]"),
        ({}, "x", r"declared_bad\(x\) has no type annotation"),
    ],
)
def test_bad_declarations_are_refused(options, signature, message):
    namespace: dict = {"jax": jax}
    exec(f"def declared_bad({signature}) -> jax.Array: ...", namespace)
    with pytest.raises(TypeError, match=message):
        op(**options)(namespace["declared_bad"])
