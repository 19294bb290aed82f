"""Public JAX API: ``rotary_embedding`` (q and k in one call) with an implementation table
(pallas, xla) and its input checks."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernel_hub.kernel_api import (
    FLOATS_AND_F64,
    Einsum,
    KernelInputError,
    check_dtype,
    check_rank,
    check_same_dtype,
    float64_problem,
    jax_platform,
    op,
    pallas_and_xla,
    require,
)

from . import pallas_tpu, reference

OP = "rotary_embedding"


def check_inputs(q, k, cos, sin, unsqueeze_dim: int = 1) -> None:
    """Shape, dtype and option rules shared by the JAX function and the torch op."""
    require(
        unsqueeze_dim in (1, 2),
        f"{OP}: unsqueeze_dim={unsqueeze_dim!r}; valid: 1 (q, k are [batch, heads, seq, dim]) "
        "or 2 ([batch, seq, heads, dim])",
    )
    for name, x in (("q", q), ("k", k)):
        check_rank(OP, name, x, 4)
        check_dtype(OP, name, x, FLOATS_AND_F64)
    for name, x in (("cos", cos), ("sin", sin)):
        check_rank(OP, name, x, 3)
        check_dtype(OP, name, x, FLOATS_AND_F64)
    check_same_dtype(OP, "cos", cos, "sin", sin)
    require(
        tuple(cos.shape) == tuple(sin.shape),
        f"{OP}: cos has shape {tuple(cos.shape)} but sin has {tuple(sin.shape)}; they must match",
    )
    seq_axis = 3 - unsqueeze_dim
    batch, seq, width = q.shape[0], q.shape[seq_axis], q.shape[-1]
    require(
        (k.shape[0], k.shape[seq_axis], k.shape[-1]) == (batch, seq, width),
        f"{OP}: q has shape {tuple(q.shape)} and k {tuple(k.shape)}; with unsqueeze_dim="
        f"{unsqueeze_dim} they must agree on batch, sequence and head dim (heads may differ)",
    )
    rot = cos.shape[-1]
    require(
        cos.shape[0] in (1, batch) and cos.shape[1] == seq,
        f"{OP}: cos has shape {tuple(cos.shape)}; it must be [1 or {batch}, {seq}, rotary dim] "
        f"for q of shape {tuple(q.shape)} (unsqueeze_dim={unsqueeze_dim})",
    )
    require(
        rot % 2 == 0 and 2 <= rot <= width,
        f"{OP}: cos's last dimension is {rot}; the rotary dim must be even and between 2 and the "
        f"head dim ({width})",
    )


def _form(q, cos, *, interleaved, unsqueeze_dim, upcast, cast_back):
    return pallas_tpu.Form(cos.shape[-1], interleaved, unsqueeze_dim, upcast, cast_back)


def _config(q, k, form, block_seq):
    if block_seq is not None:
        return pallas_tpu.BlockConfig(block_seq)
    heads = q.shape[form.heads_axis] + k.shape[form.heads_axis]
    seq = q.shape[3 - form.heads_axis]
    return pallas_tpu.default_config(seq, heads, q.shape[-1], q.dtype)


def _padded(table, width):
    return jnp.pad(table, ((0, 0), (0, 0), (0, width - table.shape[-1])))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _pallas_rotary(q, k, cos, sin, form, config, interpret):
    width = q.shape[-1]
    return pallas_tpu.forward(
        q, k, _padded(cos, width), _padded(sin, width), form, config, interpret
    )


def _pallas_fwd(q, k, cos, sin, form, config, interpret):
    return _pallas_rotary(q, k, cos, sin, form, config, interpret), (q, k, cos, sin)


def _pallas_bwd(form, config, interpret, residuals, cotangents):
    q, k, cos, sin = residuals
    gq, gk = cotangents
    width = q.shape[-1]
    dq, dk = pallas_tpu.backward(
        gq, gk, _padded(cos, width), _padded(sin, width), q.dtype, k.dtype, form, config, interpret
    )
    # cos and sin gradients (rarely wanted: they come from buffers) by XLA, dropped when unused
    options = {"interleaved": form.interleaved, "heads_axis": form.heads_axis}
    _, dcos_q, dsin_q = reference.apply_backward(gq, q, cos, sin, **options)
    _, dcos_k, dsin_k = reference.apply_backward(gk, k, cos, sin, **options)
    return dq, dk, dcos_q + dcos_k, dsin_q + dsin_k


_pallas_rotary.defvjp(_pallas_fwd, _pallas_bwd)


def _pallas(q, k, cos, sin, *, block_seq, **options):
    form = _form(q, cos, **options)
    config = _config(q, k, form, block_seq)
    return tuple(_pallas_rotary(q, k, cos, sin, form, config, jax_platform() == "cpu"))


def _pallas_problem(q, k, cos, sin, *, block_seq, **options):
    if problem := float64_problem(q, k, cos):
        return problem
    form = _form(q, cos, **options)
    seq = q.shape[3 - form.heads_axis]
    return pallas_tpu.config_problem(seq, q.dtype, _config(q, k, form, block_seq), form.heads_axis)


def _xla(q, k, cos, sin, *, block_seq, interleaved, unsqueeze_dim, upcast, cast_back):
    options = {
        "interleaved": interleaved,
        "heads_axis": unsqueeze_dim,
        "upcast": upcast,
        "cast_back": cast_back,
    }
    return reference.apply(q, cos, sin, **options), reference.apply(k, cos, sin, **options)


TABLE = pallas_and_xla(OP, _pallas, _xla, _pallas_problem)

# Sharding: batch, heads and sequence positions split freely (q's and k's heads together, so
# grouped-query shards keep whole groups); the head dim and the rotary dim stay whole (a rotation
# pairs features across them). cos and sin may be shared by the batch (size 1); their gradient is
# then summed over the batch shards. Factor names as the other rules name them: Auto meshes split
# ``batch`` and ``heads`` by them (``sharding.context.CONVENTIONAL_AXES``).
_LAYOUTS = {
    1: "batch heads seq d, batch kv_heads seq d",
    2: "batch seq heads d, batch seq kv_heads d",
}


def sharding_rule(unsqueeze_dim: int = 1, **_options) -> Einsum:
    """The rule for q and k laid out as ``unsqueeze_dim`` says (heads at axis 1 or 2)."""
    tensors = _LAYOUTS.get(unsqueeze_dim, _LAYOUTS[1])  # a bad value is refused by the checks
    return Einsum(
        f"{tensors}, batch? seq r, batch? seq r -> {tensors}",
        whole=("d", "r"),
        together=(("heads", "kv_heads"),),
        handled_by={"d": "nothing: a rotation pairs head-dim features"},
    )


def no_table_gradients(cos, sin) -> None:
    """cos and sin come from buffers in every model; the torch op does not return their
    gradients, so it refuses to drop one silently (checked whatever the grad mode: the check runs
    below autograd, where grad mode is always off)."""
    if cos.requires_grad or sin.requires_grad:
        raise KernelInputError(
            f"{OP}: cos or sin requires grad; the torch op gives gradients for q and k only "
            "(compute cos and sin under torch.no_grad() or detach them)"
        )


@op(
    check=check_inputs,
    torch_check=no_table_gradients,
    differentiable=("q", "k"),
    sharding=sharding_rule,
    jax_only=("block_seq",),
)
def rotary_embedding(
    q: jax.Array,
    k: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    *,
    unsqueeze_dim: int = 1,
    interleaved: bool = False,
    upcast: bool = False,
    cast_back: bool = False,
    implementation: str | None = None,
    block_seq: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Rotary position embedding of q and k: ``x * cos + rotate(x) * sin`` (``reference``).

    q [B, Hq, S, D] and k [B, Hk, S, D] (``unsqueeze_dim=1``; with 2, [B, S, H, D]); cos and
    sin [B or 1, S, r] for the first r <= D features (the rest pass through). ``interleaved``:
    rotate pairs (Cohere) instead of halves (Llama). ``upcast``: round in f32 (else in
    ``promote(x, cos)``, as torch does); ``cast_back``: results in q's and k's own dtypes.
    ``block_seq`` overrides the Pallas sequence block.
    """
    return TABLE(
        q,
        k,
        cos,
        sin,
        block_seq=block_seq,
        interleaved=interleaved,
        unsqueeze_dim=unsqueeze_dim,
        upcast=upcast,
        cast_back=cast_back,
        implementation=implementation,
    )
