"""Gated RMSNorm (``RMSNormGated`` of the hybrid models): the public JAX function and its
implementation table (the numerics are ``reference.gated_rms_norm``).

Two forms, with Transformers' rounding points (x̂ = normalised in f32, ``in`` = x's dtype):

* ``norm_before_gate=True`` (Qwen3-Next, Qwen3.5, Kimi-Linear, OLMo-hybrid):
  ``((weight * x̂.to(in)) * silu(gate.float())).to(in)``;
* ``norm_before_gate=False`` (Bamba, Mamba-2, Falcon-H1, Granite-4, Nemotron-H):
  ``h = x.float() * silu(gate.float())``, normalised per group of ``group_size`` channels, then
  ``weight * ĥ.to(in)`` (result in the promoted dtype of x and weight); without a gate, plain
  grouped RMSNorm.
"""

from __future__ import annotations

import math

import jax

from kernel_hub.kernel_api import (
    FLOATS_AND_F64,
    Einsum,
    check_dtype,
    check_rank,
    float64_problem,
    jax_platform,
    op,
    pallas_and_xla,
    require,
)

from . import gated_pallas
from .reference import gated_rms_norm as reference

OP = "gated_rms_norm"


def check_inputs(x, gate, weight, norm_before_gate: bool = True, group_size=None) -> None:
    check_rank(OP, "x", x, (1, 8))
    check_rank(OP, "weight", weight, 1)
    for name, value in (("x", x), ("gate", gate), ("weight", weight)):
        if value is not None:
            check_dtype(OP, name, value, FLOATS_AND_F64)
    hidden = x.shape[-1]
    require(
        tuple(weight.shape) == (hidden,),
        f"{OP}: weight has shape {tuple(weight.shape)}; it must be ({hidden},)",
    )
    if gate is not None:
        require(
            tuple(gate.shape) == tuple(x.shape),
            f"{OP}: gate has shape {tuple(gate.shape)}; it must be x's {tuple(x.shape)}",
        )
    if group_size is not None:
        require(
            isinstance(group_size, int) and group_size > 0 and hidden % group_size == 0,
            f"{OP}: group_size={group_size!r} must divide the hidden size {hidden}",
        )
    require(
        gate is not None or not norm_before_gate,
        f"{OP}: norm_before_gate=True needs a gate (use rms_norm without one)",
    )


def _xla(x, gate, weight, *, eps, norm_before_gate, group_size):
    return reference(x, gate, weight, eps, norm_before_gate, group_size)


def _pallas(x, gate, weight, *, eps, norm_before_gate, group_size):
    hidden = x.shape[-1]
    rows = math.prod(x.shape[:-1])
    interpret = jax_platform() == "cpu"
    config = gated_pallas.default_config(rows, hidden, x.dtype, interpret=interpret)
    flat_gate = None if gate is None else gate.reshape(rows, hidden)
    y = gated_pallas.gated_rms_norm_2d(
        x.reshape(rows, hidden), flat_gate, weight, eps, norm_before_gate, config, interpret
    )
    return y.reshape(x.shape)


def _pallas_problem(x, gate, weight, *, eps, norm_before_gate, group_size):
    if problem := float64_problem(x):
        return problem
    if group_size is not None and group_size != x.shape[-1]:
        return f"group_size={group_size} < hidden {x.shape[-1]}: the kernel normalises whole rows"
    return None


TABLE = pallas_and_xla(OP, _pallas, _xla, _pallas_problem)


@op(
    check=check_inputs,
    differentiable=("x", "gate", "weight"),
    sharding=Einsum(
        "... hidden, ... hidden, hidden -> ... hidden",
        whole=("hidden",),
        handled_by={"hidden": "an all-gather of x and the gate before the norm"},
    ),
)
def gated_rms_norm(
    x: jax.Array,
    gate: jax.Array | None,
    weight: jax.Array,
    eps: float = 1e-6,
    *,
    norm_before_gate: bool = True,
    group_size: int | None = None,
    implementation: str | None = None,
) -> jax.Array:
    """Gated RMSNorm over the last axis (any leading shape); see the module docstring for the
    two forms. ``group_size`` (norm after gate only) normalises groups of channels separately."""
    return TABLE(
        x,
        gate,
        weight,
        eps=eps,
        norm_before_gate=norm_before_gate,
        group_size=group_size,
        implementation=implementation,
    )
