"""Tokamax's ``ragged_dot``: its Mosaic TPU kernel on TPU, its XLA implementation elsewhere.

Tokamax differentiates it with its own VJP (the same kernel with other dimension numbers).
Tokamax is optional: it is imported on first use, and without it this implementation says so.
"""

from __future__ import annotations

import importlib.util

import jax

from kernel_hub.kernel_api import Platform

from .reference import TGMM_DIMS, gmm_dims

# Tokamax's Mosaic TPU ragged_dot refuses operands with a dimension below this, and TPUs older
# than this generation (its ``supported_on``: "Not supported on TPU v4").
MOSAIC_MIN_DIM = 128
MOSAIC_MIN_GENERATION = 5


def _tokamax():
    """Import tokamax. Its config options read absl flags, and the first read parses
    ``sys.argv`` as absl flags when nothing has parsed them yet: any host program's own
    command line (pytest's ``-x``, a script's ``--tokens``) then raises UnrecognizedFlagError.
    Marking the flags parsed keeps their defaults and leaves the command line alone."""
    import tokamax
    from absl import flags  # tokamax's own dependency

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    return tokamax


def _implementation(platform: Platform) -> str:
    return "mosaic" if platform == "tpu" else "xla"


def problem(platform: Platform, *dims: int) -> str | None:
    """Why Tokamax cannot run here (not installed, or dimensions its TPU kernel refuses)."""
    if importlib.util.find_spec("tokamax") is None:
        return "tokamax is not installed (pip install 'kernel-hub[tokamax]')"
    if platform != "tpu":
        return None
    from jax.experimental.pallas import tpu as pltpu

    generation = pltpu.get_tpu_info().generation
    if generation < MOSAIC_MIN_GENERATION:
        return f"Tokamax's Mosaic TPU ragged_dot needs TPU v5 or newer, this is v{generation}"
    if min(dims) < MOSAIC_MIN_DIM:
        return f"Tokamax's Mosaic TPU ragged_dot needs every dimension >= 128, got {dims}"
    return None


def gmm(lhs, rhs, group_sizes, *, transpose_rhs: bool, out_dtype, platform: Platform):
    return _tokamax().ragged_dot_general(
        lhs,
        rhs,
        group_sizes,
        gmm_dims(transpose_rhs),
        preferred_element_type=out_dtype,
        implementation=_implementation(platform),
    )


def tgmm(lhs, grad, group_sizes, *, out_dtype, platform: Platform) -> jax.Array:
    return _tokamax().ragged_dot_general(
        lhs,
        grad,
        group_sizes,
        TGMM_DIMS,
        preferred_element_type=out_dtype,
        implementation=_implementation(platform),
    )
