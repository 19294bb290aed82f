"""Public JAX API: ``causal_conv1d`` (whole sequences, training) and ``causal_conv1d_update``
(decode on a conv state), each with an implementation table (pallas, xla) and input checks."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernel_hub.kernel_api import (
    FLOATS_AND_F64,
    Einsum,
    check_dtype,
    check_offset_values,
    check_rank,
    float64_problem,
    jax_platform,
    op,
    pallas_and_xla,
    require,
)

from . import pallas_tpu, reference

OP = "causal_conv1d"
UPDATE_OP = "causal_conv1d_update"


def _check_common(op, x, weight, bias, activation) -> None:
    require(
        activation in reference.ACTIVATIONS,
        f"{op}: activation={activation!r}; valid: {', '.join(map(repr, reference.ACTIVATIONS))}",
    )
    check_rank(op, "x", x, 3)
    check_rank(op, "weight", weight, 2)
    for name, value in (("x", x), ("weight", weight), ("bias", bias)):
        if value is not None:
            check_dtype(op, name, value, FLOATS_AND_F64)
    require(
        weight.shape[0] == x.shape[2],
        f"{op}: weight has shape {tuple(weight.shape)}; it must be [channels, width] with "
        f"channels = x's last dimension ({x.shape[2]})",
    )
    if bias is not None:
        require(
            tuple(bias.shape) == (x.shape[2],),
            f"{op}: bias has shape {tuple(bias.shape)}; it must be ({x.shape[2]},)",
        )


def check_offsets(x, cu_seqlens=None) -> None:
    """On every call where they can be read: ``cu_seqlens`` covering x's packed tokens."""
    if cu_seqlens is not None:
        check_offset_values(OP, "cu_seqlens", cu_seqlens, x.shape[1])


def check_inputs(x, weight, bias=None, initial_state=None, cu_seqlens=None, activation=None):
    """Rules of ``causal_conv1d`` shared by the JAX function and the torch op."""
    _check_common(OP, x, weight, bias, activation)
    batch, _, channels = x.shape
    if cu_seqlens is not None:
        check_rank(OP, "cu_seqlens", cu_seqlens, 1)
        check_dtype(OP, "cu_seqlens", cu_seqlens, ("int32", "int64"))
        require(
            batch == 1 and cu_seqlens.shape[0] >= 2,
            f"{OP}: cu_seqlens packs sequences into a batch of one; got batch {batch} and "
            f"{cu_seqlens.shape[0]} offsets (need >= 2)",
        )
    if initial_state is not None:
        check_dtype(OP, "initial_state", initial_state, FLOATS_AND_F64)
        sequences = batch if cu_seqlens is None else cu_seqlens.shape[0] - 1
        wanted = (sequences, weight.shape[1] - 1, channels)
        require(
            tuple(initial_state.shape) == wanted,
            f"{OP}: initial_state has shape {tuple(initial_state.shape)}; it must be "
            f"[sequences (B, or N with cu_seqlens), width - 1, channels] = {list(wanted)}",
        )


def check_update_inputs(x, conv_state, weight, bias=None, activation=None) -> None:
    """Rules of ``causal_conv1d_update``."""
    _check_common(UPDATE_OP, x, weight, bias, activation)
    check_dtype(UPDATE_OP, "conv_state", conv_state, FLOATS_AND_F64)
    batch, _, channels = x.shape
    require(
        len(conv_state.shape) == 3
        and (conv_state.shape[0], conv_state.shape[2]) == (batch, channels)
        and conv_state.shape[1] >= weight.shape[1] - 1,
        f"{UPDATE_OP}: conv_state has shape {tuple(conv_state.shape)}; it must be "
        f"[{batch}, S, {channels}] with S >= width - 1 = {weight.shape[1] - 1}",
    )


def _pallas(x, weight, bias, initial_state, cu_seqlens, *, activation, config):
    positions = (
        None
        if cu_seqlens is None
        else reference.positions_in_sequence(x.shape[0], x.shape[1], cu_seqlens)
    )
    config = pallas_tpu.config_for(max(16, x.shape[1]), x.shape[2], config)
    return pallas_tpu.causal_conv1d(
        x, weight, bias, initial_state, positions, activation, config, jax_platform() == "cpu"
    )


def _xla(x, weight, bias, initial_state, cu_seqlens, *, activation, config):
    return reference.causal_conv1d(
        x, weight, bias, initial_state, cu_seqlens, activation=activation
    )


def _pallas_problem(x, weight, *args, config, **kwargs):
    return float64_problem(x) or pallas_tpu.config_problem(weight.shape[1], x.shape[2], config)


TABLE = pallas_and_xla(OP, _pallas, _xla, _pallas_problem)


# Sharding: batch and channels split freely (the convolution is depthwise); the sequence and the
# kernel width stay whole.
@op(
    check=check_inputs,
    check_values=check_offsets,
    differentiable=("x", "weight", "bias", "initial_state"),
    sharding=Einsum(
        "batch length channels, channels width, channels, batch history channels, offsets"
        " -> batch length channels",
        whole=("length", "width", "history", "offsets"),
        handled_by={"length": "nothing yet: a split sequence needs the previous shard's tail"},
    ),
    jax_only=("config",),
)
def causal_conv1d(
    x: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None = None,
    initial_state: jax.Array | None = None,
    cu_seqlens: jax.Array | None = None,
    *,
    activation: str | None = None,
    implementation: str | None = None,
    config: pallas_tpu.BlockConfig | None = None,
) -> jax.Array:
    """Depthwise causal convolution of x ``[B, T, D]`` with weight ``[D, W]`` (``weight[:, W-1]``
    multiplies the current token), plus bias ``[D]``, then SiLU when ``activation`` is "silu".
    ``cu_seqlens`` ``[N + 1]`` packs N sequences into a batch of one. ``initial_state``
    ``[B, W - 1, D]`` (``[N, W - 1, D]`` when packed) holds the inputs before each sequence (zeros
    when None). Returns y in x's dtype (summed in f32). ``config`` overrides the Pallas blocks."""
    if cu_seqlens is not None and initial_state is not None:
        return _packed_with_states(
            x, weight, bias, initial_state, cu_seqlens, activation, config, implementation
        )
    return TABLE(
        x,
        weight,
        bias,
        initial_state,
        cu_seqlens,
        activation=activation,
        config=config,
        implementation=implementation,
    )


def _packed_with_states(x, weight, bias, initial_state, cu_seqlens, activation, config, impl):
    """Packed sequences with initial states, through either implementation: each sequence's state
    goes in front of it as W - 1 tokens of its own, the longer packed batch is convolved from
    zeros, and only the real tokens' outputs are kept."""
    history = weight.shape[1] - 1
    if history == 0:  # width 1 reads no history: the states are empty
        initial_state = None
    sequences = cu_seqlens.shape[0] - 1
    cu = cu_seqlens.astype(jnp.int32)
    grown = cu + history * jnp.arange(sequences + 1, dtype=jnp.int32)
    position = jnp.arange(x.shape[1] + sequences * history, dtype=jnp.int32)
    owner = jnp.clip(jnp.searchsorted(grown[1:], position, side="right"), 0, sequences - 1)
    offset = position - grown[owner]
    stream = x[0, jnp.clip(cu[owner] + offset - history, 0, x.shape[1] - 1)]
    if initial_state is not None:
        dtype = jnp.promote_types(x.dtype, initial_state.dtype)
        state = initial_state[owner, jnp.clip(offset, 0, history - 1)].astype(dtype)
        stream = jnp.where((offset < history)[:, None], state, stream.astype(dtype))
    y = TABLE(
        stream[None],
        weight,
        bias,
        None,
        grown,
        activation=activation,
        config=config,
        implementation=impl,
    )
    token = jnp.arange(x.shape[1], dtype=jnp.int32)
    token_owner = jnp.clip(jnp.searchsorted(cu[1:], token, side="right"), 0, sequences - 1)
    return y[:, token + history * (token_owner + 1)].astype(x.dtype)


def _update_pallas(x, conv_state, weight, bias, *, activation):
    config = pallas_tpu.config_for(16, x.shape[2], None)
    return pallas_tpu.causal_conv1d_update(
        x, conv_state, weight, bias, activation, config, jax_platform() == "cpu"
    )


def _update_xla(x, conv_state, weight, bias, *, activation):
    return reference.causal_conv1d_update(x, conv_state, weight, bias, activation=activation)


def _update_pallas_problem(x, conv_state, weight, *args, **kwargs):
    if x.shape[1] > pallas_tpu.MAX_DECODE_TOKENS:
        return (
            f"{x.shape[1]} tokens; the update kernel unrolls at most "
            f"{pallas_tpu.MAX_DECODE_TOKENS} (use causal_conv1d with an initial state)"
        )
    return float64_problem(x)


UPDATE_TABLE = pallas_and_xla(UPDATE_OP, _update_pallas, _update_xla, _update_pallas_problem)


@op(
    check=check_update_inputs,
    sharding=Einsum(
        "batch length channels, batch history channels, channels width, channels"
        " -> batch length channels, batch history channels",
        whole=("length", "width", "history"),
    ),
)
def causal_conv1d_update(
    x: jax.Array,
    conv_state: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None = None,
    *,
    activation: str | None = None,
    implementation: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Decode step: (y ``[B, T, D]``, new conv state ``[B, S, D]``) for a few tokens x after the
    S inputs in ``conv_state`` (Transformers keeps S = W); the new state is the last S inputs of
    state + x, in the state's dtype. The Pallas kernel aliases it to ``conv_state``."""
    return UPDATE_TABLE(
        x, conv_state, weight, bias, activation=activation, implementation=implementation
    )
