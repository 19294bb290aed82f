"""Attention under a dense [B, H, Sq, Sk] mask, such as the 4-D masks Transformers builds.

The kernels take structure (causal/window rule, key padding, segment ids), not dense masks. This
module derives that structure from the mask on device and checks it reproduces the mask exactly:

* ``padding``: keys no query attends are padding, the rest follow the caller's causal/window rule;
* ``packed``: causal packed sequences; a query's first visible key marks its segment (Sq == Sk);
* otherwise the reference runs with the dense mask, one block of queries at a time, and a
  warning (once per reason) says why.

An additive ``bias`` (T5's ``position_bias``, ALiBi) always runs on the reference, forward and
backward, with its gradient: the Pallas kernel takes no dense bias (it would stream a
[B, H, Sq, Sk] operand per block), and Tokamax's public API returns no logsumexp.

The choice is a ``lax.switch`` inside one jitted function: no data-dependent Python branch, so a
torch caller keeps a single graph under ``torch.compile``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp

from kernel_hub.kernel_api import (
    SavedBackward,
    ShardingRule,
    check_dtype,
    check_rank,
    op,
    option_values,
    require,
    sharded,
    takes_options,
)

from . import api, masking, reference
from .api import GRADIENTS, LSE, OUT, RULE_OPTIONS
from .options import TORCH_1_0, AttentionSpec

log = logging.getLogger(__name__)

OP = "attention_with_dense_mask"
STRUCTURES = ("padding", "packed")
_REFERENCE_QUERY_BLOCK = 128
_BIAS_REASON = "it adds a dense bias (position_bias), which the Pallas kernel does not take"
UNUSED_OPTIONS = ("block_q", "block_k", "window_bounds_groups", "dropout_rate")
"""``AttentionSpec`` fields the dense-mask functions do not take (a dense mask has no groups;
dropout runs in ``api``'s functions, which take its seed)."""


def check_mask(query, key, mask) -> None:
    """``mask`` must broadcast to [batch, q_heads, q_len, kv_len] along batch and heads only."""
    check_rank(OP, "attention_mask", mask, 4)
    check_dtype(OP, "attention_mask", mask, ("bool", *api.FLOAT_DTYPES))
    batch, heads, q_len, _ = query.shape
    kv_len = key.shape[2]
    m_batch, m_heads, m_q, m_kv = mask.shape
    require(
        m_batch in (1, batch) and m_heads in (1, heads) and (m_q, m_kv) == (q_len, kv_len),
        f"{OP}: attention_mask has shape {tuple(mask.shape)}; expected "
        f"[{batch} or 1, {heads} or 1, {q_len}, {kv_len}] for query {tuple(query.shape)} and "
        f"key {tuple(key.shape)}",
    )


def _allowed_and_bias(mask):
    """(allowed [bool], bias or None, whether the mask is purely allow/deny)."""
    if mask.dtype == jnp.bool_:
        return mask, None, jnp.asarray(True)
    denied = mask <= jnp.finfo(mask.dtype).min / 2  # includes -inf
    allowed = ~denied
    bias = jnp.where(allowed, mask, 0)
    return allowed, bias, jnp.all(bias == 0)


def _structures(allowed, q_len: int, kv_len: int, spec: AttentionSpec):
    """Segment ids ([Bm, Sq], [Bm, Sk]) per structure in ``STRUCTURES``; None if not applicable."""
    attended = jnp.any(allowed, axis=(1, 2))
    batch = allowed.shape[0]
    padding = masking.merge_key_padding(q_len, kv_len, batch, attended, None, None)
    packed = None
    if spec.causal and q_len == kv_len:
        first_key = jnp.argmax(allowed[:, 0], axis=-1).astype(jnp.int32)
        packed = (first_key, jnp.where(attended, first_key, masking.KV_PADDING_SEGMENT))
    return padding, packed


def _choice(allowed, binary, structures, q_len: int, kv_len: int, spec: AttentionSpec):
    """Index in STRUCTURES of the first structure rebuilding the mask; len(STRUCTURES) if none."""
    choice = jnp.asarray(len(STRUCTURES), jnp.int32)
    for index in reversed(range(len(STRUCTURES))):
        ids = structures[index]
        if ids is None:
            continue
        rebuilt = masking.dense_mask(q_len, kv_len, spec, masking.TokenMask(*ids))
        exact = binary & jnp.all(rebuilt == allowed)
        choice = jnp.where(exact, index, choice)
    return choice


def _broadcast_ids(ids, batch: int):
    return tuple(jnp.broadcast_to(x, (batch, x.shape[1])) for x in ids)


@functools.cache
def _warn_once(reason: str) -> None:
    log.warning("attention: dense mask ran on the reference implementation because %s", reason)


def _log_fallback(binary) -> None:
    _warn_once(
        "it is neither key padding plus the causal/window rule nor packed causal segments"
        if binary
        else "it is an additive mask with values other than 0 and -inf"
    )


def check_bias(query, key, bias) -> None:
    """``bias`` must broadcast to [batch, q_heads, q_len, kv_len] along batch and heads only."""
    check_rank(OP, "bias", bias, 4)
    check_dtype(OP, "bias", bias, api.FLOAT_DTYPES)
    batch, heads, q_len, _ = query.shape
    kv_len = key.shape[2]
    b_batch, b_heads, b_q, b_kv = bias.shape
    require(
        b_batch in (1, batch) and b_heads in (1, heads) and (b_q, b_kv) == (q_len, kv_len),
        f"{OP}: bias has shape {tuple(bias.shape)}; expected [{batch} or 1, {heads} or 1, "
        f"{q_len}, {kv_len}] for query {tuple(query.shape)} and key {tuple(key.shape)}",
    )


def _reference(q, k, v, sinks, allowed, bias, spec: AttentionSpec):
    """Reference attention under the dense mask, a block of queries at a time (bounded memory)."""
    q_len = q.shape[2]
    block = min(q_len, _REFERENCE_QUERY_BLOCK)
    blocks = -(-q_len // block)
    padded = blocks * block

    def rows(x):  # [.., Sq, ..] on axis 2 -> [blocks, .., block, ..]
        if x is None:
            return None
        x = jnp.pad(x, [(0, 0), (0, 0), (0, padded - x.shape[2]), (0, 0)])
        return jnp.moveaxis(x.reshape(*x.shape[:2], blocks, block, x.shape[3]), 2, 0)

    # Each block is a plain attention over all keys; positions shift by the block's offset, which
    # the dense mask already encodes, so the position rules are off here.
    free = dataclasses.replace(spec, causal=False, sliding_window=None)

    @jax.checkpoint
    def one_block(args):
        q_block, allowed_block, bias_block = args
        return reference.attention(
            q_block, k, v, None, free, sinks=sinks, mask=allowed_block, bias=bias_block
        )

    out, lse = jax.lax.map(one_block, (rows(q), rows(allowed), rows(bias)))
    out = jnp.moveaxis(out, 0, 2).reshape(*q.shape[:2], padded, v.shape[3])[:, :, :q_len]
    lse = jnp.moveaxis(lse, 0, 2).reshape(*q.shape[:2], padded)[:, :, :q_len]
    return out, lse


def _analyse(query, key, mask, options: AttentionSpec):
    check_mask(query, key, mask)
    spec = options.resolved(query.shape[-1])
    q_len, kv_len = query.shape[2], key.shape[2]
    allowed, bias, binary = _allowed_and_bias(mask)
    structures = _structures(allowed, q_len, kv_len, spec)
    choice = _choice(allowed, binary, structures, q_len, kv_len, spec)
    return spec, allowed, bias, binary, structures, choice


def _branches(structures, batch: int, structured, fallback):
    """One branch per entry of STRUCTURES (the fallback where a structure does not apply), then
    the fallback, so ``_choice`` indexes it directly."""
    branches = [
        fallback if ids is None else structured(_broadcast_ids(ids, batch)) for ids in structures
    ]
    return [*branches, fallback]


def _combined_bias(mask_bias, bias):
    if bias is None:
        return mask_bias
    return bias if mask_bias is None else mask_bias.astype(bias.dtype) + bias


def _check_call(
    query,
    key,
    value,
    attention_mask,
    sinks=None,
    bias=None,
    causal: bool = False,
    sliding_window: int | None = None,
    softcap: float | None = None,
    scale: float | None = None,
) -> None:
    """The op's input check: the score options, q/k/v and sinks, the mask and the bias."""
    api.check_call(
        query, key, value, sinks=sinks, causal=causal, sliding_window=sliding_window,
        softcap=softcap, scale=scale,
    )  # fmt: skip
    check_mask(query, key, attention_mask)
    if bias is not None:
        check_bias(query, key, bias)


# Sharding: as ``api``'s rules. The mask and the additive bias are [B|1, H|1, Sq, Sk]; a size-1
# batch or head dimension broadcasts (each shard reads it whole) and the bias gradient there is
# summed over the shards splitting that factor.
_MASKED = "batch? heads? q_len kv_len"
_INPUTS = (
    "batch heads q_len head_dim, batch kv_heads kv_len head_dim, "
    f"batch kv_heads kv_len value_dim, {_MASKED}, heads, {_MASKED}"  # mask, sinks, bias
)


@sharded(
    ShardingRule.parse(
        "attention_with_dense_mask_backward",
        f"{_INPUTS}, {OUT}, {LSE}, {OUT}, {LSE} -> {GRADIENTS}, heads, {_MASKED}",
        **RULE_OPTIONS,
    )
)
@takes_options(AttentionSpec, exclude=UNUSED_OPTIONS)
def attention_with_dense_mask_backward(
    query,
    key,
    value,
    attention_mask,
    sinks,
    bias,
    out,
    lse,
    d_out,
    d_lse,
    *,
    options: AttentionSpec,
):
    """(dq, dk, dv, d_sinks, d_bias) from the saved outputs (None for absent sinks or bias); the
    same structure is chosen as in the forward."""
    spec, allowed, mask_bias, _, structures, choice = _analyse(query, key, attention_mask, options)
    if bias is not None:

        def biased(q, k, v, s, b):
            return _reference(q, k, v, s, allowed, _combined_bias(mask_bias, b), spec)

        _, pullback = jax.vjp(biased, query, key, value, sinks, bias)
        return pullback((d_out, d_lse))
    keywords = option_values(options)

    def structured(ids):
        return lambda q, k, v, s: api.attention_backward(
            q,
            k,
            v,
            None,
            *ids,
            s,
            None,
            None,
            None,
            None,
            None,
            out,
            lse,
            d_out,
            d_lse,
            **keywords,
        )

    def fallback(q, k, v, s):
        def forward(*args):
            return _reference(*args, allowed, mask_bias, spec)

        _, pullback = jax.vjp(forward, q, k, v, s)
        return pullback((d_out, d_lse))

    branches = _branches(structures, query.shape[0], structured, fallback)
    return (*jax.lax.switch(choice, branches, query, key, value, sinks), None)


@op(
    check=_check_call,
    differentiable=("query", "key", "value", "sinks", "bias"),
    sharding=ShardingRule.parse(
        "attention_with_dense_mask", f"{_INPUTS} -> {OUT}, {LSE}", **RULE_OPTIONS
    ),
    torch_after={"attention_mask": tuple(n for n in TORCH_1_0 if n not in UNUSED_OPTIONS)},
    jax_backward=SavedBackward(
        attention_with_dense_mask_backward, ("out", "lse", "d_out", "d_lse")
    ),
    autocast=("query", "key", "value"),
)
@takes_options(AttentionSpec, exclude=UNUSED_OPTIONS)
def attention_with_dense_mask(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    attention_mask: jax.Array,
    sinks: jax.Array | None = None,
    bias: jax.Array | None = None,
    *,
    options: AttentionSpec,
) -> tuple[jax.Array, jax.Array]:
    """(out, logsumexp) of attention where ``attention_mask`` (bool, True = attend; or additive)
    decides visibility. ``causal``/``sliding_window`` describe the rule the mask is expected to
    follow (end-aligned, see ``masking``); a mask that does not still gives exact results.
    ``sinks`` [Hq] as in ``api.dot_product_attention``; ``bias`` [B|1, H|1, Sq, Sk] is added to
    the scores (see the module docstring)."""
    spec, allowed, mask_bias, binary, structures, choice = _analyse(
        query, key, attention_mask, options
    )
    if bias is not None:
        jax.debug.callback(functools.partial(_warn_once, _BIAS_REASON))
        return _reference(query, key, value, sinks, allowed, _combined_bias(mask_bias, bias), spec)
    keywords = option_values(options)

    def structured(ids):
        return lambda q, k, v, s: api.dot_product_attention_with_lse(
            q, k, v, None, *ids, s, **keywords
        )

    def fallback(q, k, v, s):
        jax.debug.callback(_log_fallback, binary)
        return _reference(q, k, v, s, allowed, mask_bias, spec)

    branches = _branches(structures, query.shape[0], structured, fallback)
    return jax.lax.switch(choice, branches, query, key, value, sinks)
