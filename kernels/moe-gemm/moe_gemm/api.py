"""Public JAX API: ``gmm`` and ``tgmm`` with implementation tables (pallas, tokamax, xla,
xla_loop), and ``gmm_quantized`` (int8 / fp8 expert weights; pallas, xla).

Group sizes are data. Values that can be read without stalling a device (numpy arrays, CPU
JAX arrays outside a trace, CPU tensors at the torch op) are checked: negative sizes or a sum
above ``m`` raise. Traced values, and values on an accelerator, are not read; every
implementation then takes them the same defined way: a negative size counts as 0 and rows past
``m`` are dropped from the last groups (``schedule.group_bounds``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from kernel_hub.kernel_api import (
    Implementation,
    ImplementationTable,
    Platform,
    check_dtype,
    check_rank,
    check_same_dtype,
    dtype_name,
    host_values,
    jax_platform,
    op,
    require,
    weight_formats,
)

from . import pallas_tpu, quantized, reference, sharding, tokamax_ragged_dot, vjp, xla_loop
from .schedule import sanitized_sizes
from .tiling import Tiling, contraction_problem, tiling_problem

FLOAT_DTYPES = ("float32", "bfloat16", "float64")
INT_DTYPES = ("int32", "int64")


def _check_group_sizes_arg(op: str, group_sizes, num_groups: int | None = None) -> None:
    """Rank 1, integer, at least one group (and ``num_groups`` entries when that is known)."""
    check_rank(op, "group_sizes", group_sizes, 1)
    check_dtype(op, "group_sizes", group_sizes, INT_DTYPES)
    require(group_sizes.shape[0] >= 1, f"{op}: group_sizes needs at least one group")
    require(
        num_groups is None or group_sizes.shape[0] == num_groups,
        f"{op}: group_sizes has {group_sizes.shape[0]} entries but rhs has {num_groups} "
        f"groups; it needs one size per group",
    )


def check_gmm_inputs(lhs, rhs, group_sizes, transpose_rhs: bool = False) -> None:
    """Shape and dtype rules of ``gmm``, shared by the JAX function and the torch op."""
    op = "gmm"
    check_rank(op, "lhs", lhs, 2)
    check_rank(op, "rhs", rhs, 3)
    check_dtype(op, "lhs", lhs, FLOAT_DTYPES)
    check_dtype(op, "rhs", rhs, FLOAT_DTYPES)
    check_same_dtype(op, "lhs", lhs, "rhs", rhs)
    k_axis = 2 if transpose_rhs else 1
    layout = "[E, n, k] (transpose_rhs=True)" if transpose_rhs else "[E, k, n]"
    require(
        rhs.shape[k_axis] == lhs.shape[1],
        f"{op}: lhs {tuple(lhs.shape)} has k={lhs.shape[1]} but rhs {tuple(rhs.shape)} read as "
        f"{layout} has k={rhs.shape[k_axis]}",
    )
    _check_group_sizes_arg(op, group_sizes, rhs.shape[0])


def check_tgmm_inputs(lhs, grad, group_sizes) -> None:
    """Shape and dtype rules of ``tgmm``, shared by the JAX function and the torch op."""
    op = "tgmm"
    check_rank(op, "lhs", lhs, 2)
    check_rank(op, "grad", grad, 2)
    check_dtype(op, "lhs", lhs, FLOAT_DTYPES)
    check_dtype(op, "grad", grad, FLOAT_DTYPES)
    check_same_dtype(op, "lhs", lhs, "grad", grad)
    require(
        lhs.shape[0] == grad.shape[0],
        f"{op}: lhs {tuple(lhs.shape)} and grad {tuple(grad.shape)} need the same number of rows",
    )
    _check_group_sizes_arg(op, group_sizes)


def check_group_size_values(op: str, sizes: Sequence[int], rows: int) -> None:
    """Concrete group sizes: none negative, and together no more than the ``rows`` of lhs."""
    sizes = [int(s) for s in sizes]
    negative = [i for i, s in enumerate(sizes) if s < 0]
    require(
        not negative,
        f"{op}: group_sizes must be >= 0; groups {negative} have sizes "
        f"{[sizes[i] for i in negative]}",
    )
    require(
        sum(sizes) <= rows,
        f"{op}: group_sizes sum to {sum(sizes)} but lhs has {rows} rows; they may sum to at "
        f"most {rows} (rows past the sum give zeros)",
    )


def _out_dtype(dtype, preferred_element_type):
    """The result dtype; ``preferred_element_type`` may be a JAX, numpy or torch dtype."""
    if preferred_element_type is None:
        return jnp.dtype(dtype)
    try:
        out = jnp.dtype(preferred_element_type)
    except TypeError:  # a torch dtype (the torch op passes its argument through)
        out = jnp.dtype(dtype_name(preferred_element_type))
    require(
        out.name in FLOAT_DTYPES,
        f"preferred_element_type must be one of {', '.join(FLOAT_DTYPES)}, got {out.name}",
    )
    return out


def _interpret() -> bool:
    return jax_platform() == "cpu"


def _pallas_problem(kind: str, m: int, k: int, n: int, dtype, tiling: Tiling | None) -> str | None:
    if jnp.dtype(dtype).name == "float64" and not _interpret():
        return "float64 runs only in interpret mode (CPU)"
    if tiling is None:
        return None
    # interpret mode has no TPU block rules, but a ragged contraction is wrong everywhere
    return (
        contraction_problem(kind, k, tiling)
        if _interpret()
        else tiling_problem(kind, m, k, n, dtype, tiling)
    )


def _gmm_n(rhs, transpose_rhs: bool) -> int:
    return rhs.shape[1] if transpose_rhs else rhs.shape[2]


# --- Raw kernels of each implementation; ``vjp`` makes them differentiable. ---


def _pallas_gmm(lhs, rhs, group_sizes, *, transpose_rhs, out_dtype, tiling):
    return pallas_tpu.gmm(
        lhs,
        rhs,
        group_sizes,
        transpose_rhs=transpose_rhs,
        out_dtype=out_dtype,
        tiling=tiling,
        interpret=_interpret(),
    )


def _pallas_tgmm(lhs, grad, group_sizes, *, out_dtype, tiling):
    return pallas_tpu.tgmm(
        lhs, grad, group_sizes, out_dtype=out_dtype, tiling=tiling, interpret=_interpret()
    )


def _tokamax_gmm(lhs, rhs, group_sizes, *, transpose_rhs, out_dtype, tiling):
    return tokamax_ragged_dot.gmm(
        lhs,
        rhs,
        group_sizes,
        transpose_rhs=transpose_rhs,
        out_dtype=out_dtype,
        platform=jax_platform(),
    )


def _tokamax_tgmm(lhs, grad, group_sizes, *, out_dtype, tiling):
    return tokamax_ragged_dot.tgmm(
        lhs, grad, group_sizes, out_dtype=out_dtype, platform=jax_platform()
    )


def _xla_gmm(lhs, rhs, group_sizes, *, transpose_rhs, out_dtype, tiling):
    return reference.gmm(lhs, rhs, group_sizes, transpose_rhs=transpose_rhs, out_dtype=out_dtype)


def _xla_tgmm(lhs, grad, group_sizes, *, out_dtype, tiling):
    return reference.tgmm(lhs, grad, group_sizes, out_dtype=out_dtype)


BACKENDS = {
    "pallas": vjp.Backend(_pallas_gmm, _pallas_tgmm),
    "tokamax": vjp.Backend(_tokamax_gmm, _tokamax_tgmm),
    "xla": vjp.Backend(_xla_gmm, _xla_tgmm),
    "xla_loop": vjp.Backend(xla_loop.gmm, xla_loop.tgmm),
}

# --- Why an implementation cannot take the inputs (None: it can). ---


def _gmm_pallas_problem(lhs, rhs, group_sizes, *, transpose_rhs, out_dtype, tiling):
    (m, k), n = lhs.shape, _gmm_n(rhs, transpose_rhs)
    return _pallas_problem("gmm", m, k, n, lhs.dtype, tiling)


def _gmm_tokamax_problem(lhs, rhs, group_sizes, *, transpose_rhs, out_dtype, tiling):
    return tokamax_ragged_dot.problem(jax_platform(), *lhs.shape, _gmm_n(rhs, transpose_rhs))


def _tgmm_pallas_problem(lhs, grad, group_sizes, *, out_dtype, tiling):
    return _pallas_problem("tgmm", *lhs.shape, grad.shape[1], lhs.dtype, tiling)


def _tgmm_tokamax_problem(lhs, grad, group_sizes, *, out_dtype, tiling):
    return tokamax_ragged_dot.problem(jax_platform(), *lhs.shape, grad.shape[1])


EVERYWHERE: tuple[Platform, ...] = ("tpu", "gpu", "cpu")
PLATFORMS: dict[str, tuple[Platform, ...]] = {
    "pallas": ("tpu", "cpu"),
    "tokamax": EVERYWHERE,
    "xla": EVERYWHERE,
    "xla_loop": ("cpu",),
}
DEFAULT_ORDER: dict[Platform, tuple[str, ...]] = {
    "tpu": ("pallas", "tokamax", "xla"),
    "gpu": ("xla",),
    # Measured on CPU (benchmarks/moe_block_cpu.py): xla_loop is several times faster than
    # XLA's ragged_dot there; Pallas in interpret mode is slower than both.
    "cpu": ("xla_loop", "xla", "tokamax", "pallas"),
}
GMM_PROBLEMS = {"pallas": _gmm_pallas_problem, "tokamax": _gmm_tokamax_problem}
TGMM_PROBLEMS = {"pallas": _tgmm_pallas_problem, "tokamax": _tgmm_tokamax_problem}

GMM_TABLE = ImplementationTable(
    "gmm",
    [
        Implementation(
            name, functools.partial(vjp.gmm, backend), PLATFORMS[name], GMM_PROBLEMS.get(name)
        )
        for name, backend in BACKENDS.items()
    ],
    default_order=DEFAULT_ORDER,
)
TGMM_TABLE = ImplementationTable(
    "tgmm",
    [
        Implementation(
            name, functools.partial(vjp.tgmm, backend), PLATFORMS[name], TGMM_PROBLEMS.get(name)
        )
        for name, backend in BACKENDS.items()
    ],
    default_order=DEFAULT_ORDER,
)


def _sizes_check(op_name: str):
    """The ops' check of group size values on every call, where they can be read without
    stalling a device (``host_values``: numpy, CPU arrays and eager CPU tensors; see the module
    doc for what traced or device sizes do)."""

    def check(lhs, group_sizes) -> None:
        sizes = host_values(group_sizes)
        if sizes is not None:
            check_group_size_values(op_name, sizes.tolist(), lhs.shape[0])

    return check


# The torch ops' backward runs only the backward kernels: no forward recomputed (and left to DCE).
def _gmm_backward(
    inputs, outputs, cotangents, *, transpose_rhs, preferred_element_type, implementation
):
    return gmm_vjp(
        inputs["lhs"],
        inputs["rhs"],
        inputs["group_sizes"],
        cotangents[0],
        transpose_rhs=transpose_rhs,
        implementation=implementation,
    )


def _tgmm_backward(inputs, outputs, cotangents, *, preferred_element_type, implementation):
    return tgmm_vjp(
        inputs["lhs"],
        inputs["grad"],
        inputs["group_sizes"],
        cotangents[0],
        implementation=implementation,
    )


def _gmm_quantized_backward(
    inputs, outputs, cotangents, *, transpose_rhs, preferred_element_type, implementation
):
    return (
        gmm_quantized_vjp(
            inputs["lhs"],
            inputs["weight"],
            inputs["scale"],
            inputs["group_sizes"],
            cotangents[0],
            transpose_rhs=transpose_rhs,
            implementation=implementation,
        ),
    )


@op(
    check=check_gmm_inputs,
    check_values=_sizes_check("gmm"),
    differentiable=("lhs", "rhs"),
    jax_backward=_gmm_backward,
    sharding=sharding.gmm_rule,
    jax_only=("tiling",),
)
def gmm(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    transpose_rhs: bool = False,
    preferred_element_type: jax.typing.DTypeLike | None = None,
    implementation: str | None = None,
    tiling: Tiling | None = None,
) -> jax.Array:
    """Grouped matmul: ``lhs`` [m, k] rows sorted by group, ``rhs`` [E, k, n] (or [E, n, k] with
    ``transpose_rhs``), ``group_sizes`` [E] rows per group -> [m, n].

    Rows past ``sum(group_sizes)`` come out as zeros. The result has ``preferred_element_type``
    (default: the input dtype); accumulation is f32. Differentiable in ``lhs`` and ``rhs``.
    ``implementation`` forces "pallas", "tokamax", "xla" or "xla_loop" (CPU); ``tiling`` sets the
    Pallas blocks.
    """
    out_dtype = _out_dtype(lhs.dtype, preferred_element_type)
    n = _gmm_n(rhs, transpose_rhs)
    if 0 in (lhs.shape[0], lhs.shape[1], n):
        return jnp.zeros((lhs.shape[0], n), out_dtype)
    sizes = sanitized_sizes(jnp.asarray(group_sizes), lhs.shape[0])
    return GMM_TABLE(
        lhs,
        rhs,
        sizes,
        transpose_rhs=transpose_rhs,
        out_dtype=out_dtype,
        tiling=tiling,
        implementation=implementation,
    )


@op(
    check=check_tgmm_inputs,
    check_values=_sizes_check("tgmm"),
    differentiable=("lhs", "grad"),
    jax_backward=_tgmm_backward,
    sharding=sharding.TGMM,
    jax_only=("tiling",),
)
def tgmm(
    lhs: jax.Array,
    grad: jax.Array,
    group_sizes: jax.Array,
    *,
    preferred_element_type: jax.typing.DTypeLike | None = None,
    implementation: str | None = None,
    tiling: Tiling | None = None,
) -> jax.Array:
    """Per-group ``lhs[rows of g].T @ grad[rows of g]``: ``lhs`` [m, k], ``grad`` [m, n] ->
    [E, k, n], E = ``len(group_sizes)``. The weight gradient of ``gmm``; groups without rows
    give zeros. Differentiable in ``lhs`` and ``grad``.
    """
    out_dtype = _out_dtype(lhs.dtype, preferred_element_type)
    shape = (group_sizes.shape[0], lhs.shape[1], grad.shape[1])
    if 0 in (lhs.shape[0], *shape[1:]):
        return jnp.zeros(shape, out_dtype)
    sizes = sanitized_sizes(jnp.asarray(group_sizes), lhs.shape[0])
    return TGMM_TABLE(
        lhs, grad, sizes, out_dtype=out_dtype, tiling=tiling, implementation=implementation
    )


@sharding.gmm_vjp_boundary
def gmm_vjp(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    dout: jax.Array,
    *,
    transpose_rhs: bool = False,
    implementation: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """(dlhs, drhs) of ``gmm`` for the output cotangent ``dout`` [m, n], without the forward
    (what ``jax.vjp`` of ``gmm`` computes, for callers that keep no forward residuals)."""
    check_gmm_inputs(lhs, rhs, group_sizes, transpose_rhs)
    if 0 in (lhs.shape[0], lhs.shape[1], _gmm_n(rhs, transpose_rhs)):
        return jnp.zeros_like(lhs), jnp.zeros_like(rhs)
    sizes = sanitized_sizes(jnp.asarray(group_sizes), lhs.shape[0])
    chosen = GMM_TABLE.select(
        lhs,
        rhs,
        sizes,
        transpose_rhs=transpose_rhs,
        out_dtype=lhs.dtype,
        tiling=None,
        implementation=implementation,
    )
    return vjp.gmm_backward(
        BACKENDS[chosen.name], lhs, rhs, sizes, dout, transpose_rhs=transpose_rhs
    )


@sharding.tgmm_vjp_boundary
def tgmm_vjp(
    lhs: jax.Array,
    grad: jax.Array,
    group_sizes: jax.Array,
    dout: jax.Array,
    *,
    implementation: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """(dlhs, dgrad) of ``tgmm`` for the output cotangent ``dout`` [E, k, n], without the
    forward."""
    check_tgmm_inputs(lhs, grad, group_sizes)
    if 0 in (lhs.shape[0], lhs.shape[1], grad.shape[1]):
        return jnp.zeros_like(lhs), jnp.zeros_like(grad)
    sizes = sanitized_sizes(jnp.asarray(group_sizes), lhs.shape[0])
    chosen = TGMM_TABLE.select(
        lhs, grad, sizes, out_dtype=lhs.dtype, tiling=None, implementation=implementation
    )
    return vjp.tgmm_backward(BACKENDS[chosen.name], lhs, grad, sizes, dout)


def _gmm_quantized_pallas_problem(lhs, weight, scale, sizes, *, transpose_rhs, out_dtype, tiling):
    (m, k), n = lhs.shape, _gmm_n(weight, transpose_rhs)
    problem = _pallas_problem("gmm", m, k, n, lhs.dtype, tiling)
    if problem or tiling is None or quantized.weight_format(weight) != "fp8":
        return problem
    if tiling.tk % weight_formats.FP8_BLOCK or tiling.tn % weight_formats.FP8_BLOCK:
        return f"fp8 weights need tk and tn multiples of 128 (whole scale blocks), got {tiling}"
    return None


GMM_QUANTIZED_TABLE = ImplementationTable(
    "gmm_quantized",
    [
        Implementation(
            name,
            quantized.differentiable(name),
            PLATFORMS[name],
            _gmm_quantized_pallas_problem if name == "pallas" else None,
        )
        for name in quantized.KERNELS
    ],
    default_order={
        "tpu": ("pallas", "xla"),
        "gpu": ("xla",),
        "cpu": ("xla", "pallas"),  # Pallas runs in interpret mode on CPU
    },
)


# Quantized weights are frozen: a weight or scale that requires grad (in grad mode) is refused
# before any kernel runs.
@op(
    check=quantized.check_inputs,
    check_values=_sizes_check("gmm_quantized"),
    differentiable=("lhs",),
    frozen=("weight", "scale"),
    jax_backward=_gmm_quantized_backward,
    sharding=sharding.gmm_quantized_rule,
    jax_only=("tiling",),
)
def gmm_quantized(
    lhs: jax.Array,
    weight: jax.Array,
    scale: jax.Array,
    group_sizes: jax.Array,
    *,
    transpose_rhs: bool = True,
    preferred_element_type: jax.typing.DTypeLike | None = None,
    implementation: str | None = None,
    tiling: Tiling | None = None,
) -> jax.Array:
    """Grouped matmul with quantized expert weights: ``lhs`` [m, k] rows sorted by expert,
    ``weight`` int8 or float8_e4m3fn [E, out, in] (Transformers' expert layout), ``scale`` f32
    (int8: [E, out], one per output channel; fp8: [E, out / 128, in / 128], one per block),
    ``group_sizes`` [E] -> ``lhs @ W[g]^T`` [m, out] (``transpose_rhs=True``: a projection's
    forward) or ``lhs @ W[g]`` [m, in] (``transpose_rhs=False``), ``W = weight * scale``.

    The Pallas kernel dequantizes each weight block in VMEM (f32 accumulation); XLA dequantizes
    the whole weight first. Rows past ``sum(group_sizes)`` give zeros; the result has
    ``preferred_element_type`` (default: lhs's dtype). Differentiable in ``lhs`` only: quantized
    weights are frozen, no gradient reaches ``weight`` or ``scale`` (``stop_gradient``).
    ``implementation``: "pallas" or "xla"; ``tiling``: the Pallas blocks (fp8: tk, tn multiples
    of 128).
    """
    out_dtype = _out_dtype(lhs.dtype, preferred_element_type)
    n = _gmm_n(weight, transpose_rhs)
    if 0 in (lhs.shape[0], lhs.shape[1], n):
        return jnp.zeros((lhs.shape[0], n), out_dtype)
    sizes = sanitized_sizes(jnp.asarray(group_sizes), lhs.shape[0])
    return GMM_QUANTIZED_TABLE(
        lhs,
        jax.lax.stop_gradient(weight),
        jax.lax.stop_gradient(scale),
        sizes,
        transpose_rhs=transpose_rhs,
        out_dtype=out_dtype,
        tiling=tiling,
        implementation=implementation,
    )


@sharding.gmm_quantized_vjp_boundary
def gmm_quantized_vjp(
    lhs: jax.Array,
    weight: jax.Array,
    scale: jax.Array,
    group_sizes: jax.Array,
    dout: jax.Array,
    *,
    transpose_rhs: bool = True,
    implementation: str | None = None,
) -> jax.Array:
    """``d lhs`` of ``gmm_quantized`` for the output cotangent ``dout``, without the forward."""
    quantized.check_inputs(lhs, weight, scale, group_sizes, transpose_rhs)
    if 0 in (lhs.shape[0], lhs.shape[1], _gmm_n(weight, transpose_rhs)):
        return jnp.zeros_like(lhs)
    sizes = sanitized_sizes(jnp.asarray(group_sizes), lhs.shape[0])
    chosen = GMM_QUANTIZED_TABLE.select(
        lhs,
        weight,
        scale,
        sizes,
        transpose_rhs=transpose_rhs,
        out_dtype=lhs.dtype,
        tiling=None,
        implementation=implementation,
    )
    return quantized.backward(
        chosen.name, weight, scale, sizes, dout.astype(lhs.dtype), transpose_rhs
    )
