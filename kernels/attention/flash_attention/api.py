"""Public JAX API: ``dot_product_attention`` with an implementation table and input checks.

Implementations: ``pallas`` (this package's flash kernel; interpret mode on CPU), ``tokamax``
(Tokamax's ``dot_product_attention``) and ``xla`` (the plain reference). All follow the mask rules
in ``masking``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernel_hub.kernel_api import (
    Implementation,
    ImplementationTable,
    SavedBackward,
    ShardingRule,
    check_dtype,
    check_int32_values,
    check_rank,
    dtype_name,
    jax_default_device,
    jax_platform,
    op,
    require,
    sharded,
    takes_options,
    tpu_generation,
)

from . import dropout, masking, pallas_tpu, reference
from . import tokamax as tokamax_impl
from .masking import TokenMask
from .options import TORCH_1_0, AttentionSpec

OP = "dot_product_attention"
FLOAT_DTYPES = ("float32", "bfloat16", "float16", "float64")
INT_DTYPES = ("int32", "int64", "int16", "int8", "uint8")


def _check_shape(arg: str, value, expected: tuple[int, ...], meaning: str) -> None:
    require(
        tuple(value.shape) == expected,
        f"{OP}: {arg} has shape {tuple(value.shape)}; expected {expected} ({meaning})",
    )


def check_inputs(
    query,
    key,
    value,
    kv_mask=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    sinks=None,
    q_positions=None,
    kv_positions=None,
    q_groups=None,
    kv_groups=None,
    dropout_seed=None,
) -> None:
    """Shape and dtype rules shared by the JAX functions and the torch ops (the options check
    themselves, see ``AttentionSpec``)."""
    for name, array in (("query", query), ("key", key), ("value", value)):
        check_rank(OP, name, array, 4)
        check_dtype(OP, name, array, FLOAT_DTYPES)
    require(
        dtype_name(query.dtype) == dtype_name(key.dtype) == dtype_name(value.dtype),
        f"{OP}: query, key and value must share a dtype; got {dtype_name(query.dtype)}, "
        f"{dtype_name(key.dtype)}, {dtype_name(value.dtype)}",
    )
    batch, q_heads, q_len, head_dim = query.shape
    _, kv_heads, kv_len, _ = key.shape
    value_dim = value.shape[-1]
    require(
        q_len > 0 and kv_len > 0 and head_dim > 0 and value_dim > 0,
        f"{OP}: empty sequence or head dim: query {tuple(query.shape)}, key "
        f"{tuple(key.shape)}, value {tuple(value.shape)}",
    )
    _check_shape(
        "key",
        key,
        (batch, kv_heads, kv_len, head_dim),
        "[batch, kv_heads, kv_len, head_dim] with query's batch and head_dim",
    )
    _check_shape(
        "value",
        value,
        (batch, kv_heads, kv_len, value_dim),
        "key's [batch, kv_heads, kv_len] and any value head dim",
    )
    require(
        kv_heads > 0 and q_heads % kv_heads == 0,
        f"{OP}: key/value have {kv_heads} heads, which must divide query's {q_heads} heads "
        f"(grouped-query attention); valid kv head counts: "
        f"{', '.join(str(d) for d in range(1, q_heads + 1) if q_heads % d == 0)}",
    )
    if kv_mask is not None:
        _check_shape("kv_mask", kv_mask, (batch, kv_len), "[batch, kv_len], True = attend")
        check_dtype(OP, "kv_mask", kv_mask, ("bool",))
    pairs = (
        ("segment_ids", q_segment_ids, kv_segment_ids),
        ("positions", q_positions, kv_positions),
        ("groups", q_groups, kv_groups),
    )
    for name, q_values, kv_values in pairs:
        require(
            (q_values is None) == (kv_values is None),
            f"{OP}: pass both q_{name} and kv_{name}, or neither",
        )
        if q_values is not None:
            _check_shape(f"q_{name}", q_values, (batch, q_len), "[batch, q_len]")
            _check_shape(f"kv_{name}", kv_values, (batch, kv_len), "[batch, kv_len]")
            check_dtype(OP, f"q_{name}", q_values, INT_DTYPES)
            check_dtype(OP, f"kv_{name}", kv_values, INT_DTYPES)
    if sinks is not None:
        _check_shape("sinks", sinks, (q_heads,), "one logit per query head")
        check_dtype(OP, "sinks", sinks, FLOAT_DTYPES)
    if dropout_seed is not None:
        _check_shape("dropout_seed", dropout_seed, (), "one integer: a scalar")
        check_dtype(OP, "dropout_seed", dropout_seed, INT_DTYPES)


# --------------------------------------------------------------------------------------------
# Implementations: fn(q, k, v, tokens: TokenMask | None, sinks, *, spec, with_lse, seed), ``spec``
# resolved (``AttentionSpec.resolved``), ``seed`` the dropout's ``dropout.words`` (None when
# ``spec.dropout_rate`` is 0).


def _interpret() -> bool:
    return jax_platform() == "cpu"


def _kernel_blocks(q, k, v, tokens, spec: AttentionSpec) -> pallas_tpu.KernelBlocks:
    interpret = _interpret()
    defaults = pallas_tpu.default_blocks(
        q.shape,
        k.shape,
        q.dtype,
        interpret=interpret,
        value_dim=v.shape[-1],
        generation=None if interpret else tpu_generation(jax_default_device()),
        every_pair=tokens is None and not spec.causal and spec.sliding_window is None,
    )
    if spec.block_q is None and spec.block_k is None:
        return pallas_tpu.unpadded(defaults, q.shape[2], k.shape[2])

    def override(blocks: pallas_tpu.BlockSizes) -> pallas_tpu.BlockSizes:
        return pallas_tpu.BlockSizes(  # 0 is a block size (refused), not "the default"
            blocks.q if spec.block_q is None else spec.block_q,
            blocks.k if spec.block_k is None else spec.block_k,
        )

    return pallas_tpu.KernelBlocks(override(defaults.forward), override(defaults.backward))


def _pallas(q, k, v, tokens, sinks, *, spec, with_lse, seed=None):
    blocks = _kernel_blocks(q, k, v, tokens, spec)
    kernel = pallas_tpu.attention if with_lse else pallas_tpu.attention_out
    return kernel(q, k, v, tokens, sinks, spec, blocks, _interpret(), seed, spec.dropout_rate)


def _empty_problem(q) -> str | None:
    """An empty batch or no query heads: the kernels have no block to run (XLA's einsum returns
    the empty result, as torch's SDPA does)."""
    if q.shape[0] == 0 or q.shape[1] == 0:
        return f"an empty batch or no query heads (query {tuple(q.shape)}): nothing to run"
    return None


def _pallas_problem(q, k, v, tokens, sinks, *, spec, with_lse, seed=None):
    if empty := _empty_problem(q):
        return empty
    if q.dtype == jnp.float64 and not _interpret():
        return "float64 runs only in interpret mode (CPU)"
    if spec.block_q is None and spec.block_k is None:
        return None
    blocks = _kernel_blocks(q, k, v, tokens, spec).forward
    return pallas_tpu.blocks_problem(q.shape, k.shape, q.dtype, blocks, interpret=_interpret())


def _tokamax(q, k, v, tokens, sinks, *, spec, with_lse, seed=None):
    ids = (None, None) if tokens is None else (tokens.q_segment_ids, tokens.kv_segment_ids)
    return tokamax_impl.attention(q, k, v, *ids, spec)


def _tokamax_problem(q, k, v, tokens, sinks, *, spec, with_lse, seed=None):
    if empty := _empty_problem(q):
        return empty
    if spec.dropout_rate:
        return (
            "Tokamax's public dot_product_attention has no attention dropout (its splash kernel "
            "takes no dropout mask or seed)"
        )
    if missing := tokamax_impl.missing():
        return missing
    # Tokamax 0.0.12 has no form of positions or groups its kernel runs: the public
    # dot_product_attention takes no segment ids, positions or mask function, only a dense boolean
    # mask (O(S^2)) and k_start/k_end ranges (local_window_size, key_value_seq_lengths). Its
    # Mosaic TPU kernel refuses those ranges and any batched or per-head boolean mask
    # (pallas_mosaic_tpu_common: check_inputs_support, build_splash_kernel raise
    # NotImplementedError), and the q_indices/k_indices its op class takes are not passed to the
    # splash kernel. A dense mask would only reach Tokamax's XLA path, as dense as ours.
    if tokens is not None and (tokens.has_positions or tokens.has_groups):
        return (
            "Tokamax's public dot_product_attention takes no per-token positions or groups (only "
            "a dense [B, N, Sq, Sk] mask, which its Mosaic kernel refuses when batched)"
        )
    if with_lse:
        return "Tokamax's public dot_product_attention returns no logsumexp"
    if sinks is not None:
        return "Tokamax's public dot_product_attention has no attention sinks"
    if v.shape[-1] != q.shape[-1]:
        return (
            f"Tokamax's dot_product_attention needs value head dim == query/key head dim "
            f"(got {v.shape[-1]} and {q.shape[-1]})"
        )
    if q.dtype == jnp.float64:
        return "Tokamax does not take float64"
    platform = jax_platform()
    if q.dtype != jnp.float32 and platform == "cpu":
        return f"Tokamax's XLA path on CPU lacks the {q.dtype.name} dot algorithm it asks for"
    if platform == "tpu":
        if tpu_generation(jax_default_device()) == "v4":
            return "Tokamax's Mosaic attention does not run on TPU v4"
        if q.shape[2] % 128 or k.shape[2] % 128:
            return (
                f"Tokamax's Mosaic attention needs q_len and kv_len divisible by 128 (got "
                f"{q.shape[2]}, {k.shape[2]}); it raises instead of falling back"
            )
    return None


def _xla(q, k, v, tokens, sinks, *, spec, with_lse, seed=None):
    drop = (seed, spec.dropout_rate) if spec.dropout_rate else None
    out, lse = reference.attention(q, k, v, tokens, spec, sinks=sinks, dropout=drop)
    return (out, lse) if with_lse else out


TABLE = ImplementationTable(
    OP,
    [
        Implementation("pallas", _pallas, ("tpu", "cpu"), _pallas_problem),
        Implementation("tokamax", _tokamax, ("tpu", "gpu", "cpu"), _tokamax_problem),
        Implementation("xla", _xla, ("tpu", "gpu", "cpu")),
    ],
    default_order={
        "tpu": ("pallas", "tokamax", "xla"),
        "gpu": ("tokamax", "xla"),
        "cpu": ("xla", "pallas", "tokamax"),
    },
)


def _int32(x):
    return None if x is None else jnp.asarray(x, jnp.int32)


def _prepare(query, key, kv_mask, q_segment_ids, kv_segment_ids, *token_arrays):
    """The per-token arrays as a ``TokenMask`` (None when there are none), key padding folded
    into int32 segment ids (see ``masking.merge_key_padding``)."""
    ids = masking.merge_key_padding(
        query.shape[2],
        key.shape[2],
        query.shape[0],
        kv_mask,
        _int32(q_segment_ids),
        _int32(kv_segment_ids),
    )
    tokens = TokenMask(*ids, *(_int32(x) for x in token_arrays))
    return None if tokens.empty else tokens


def _dropout_words(spec: AttentionSpec, dropout_seed, query, split_axes):
    """The implementations' ``seed``: None without dropout, else ``dropout.words`` with this
    shard's first global batch index and query head (``split_axes``: the mesh axes splitting
    them, from the sharding boundary; each shard holds an equal block)."""
    if not spec.dropout_rate:
        return None
    axes = split_axes or {}
    batch, heads = query.shape[:2]
    offsets = (
        jax.lax.axis_index(axes[factor]) * size if axes.get(factor) else 0
        for factor, size in (("batch", batch), ("heads", heads))
    )
    return dropout.words(dropout_seed, *offsets)


def _attention(*arrays, options: AttentionSpec, with_lse: bool, split_axes):
    """The forward of ``arrays`` (the public functions' array arguments, in order)."""
    query, key, value, kv_mask, q_segment_ids, kv_segment_ids, sinks, *token_arrays, seed = arrays
    spec = options.resolved(query.shape[-1])
    tokens = _prepare(query, key, kv_mask, q_segment_ids, kv_segment_ids, *token_arrays)
    return TABLE(
        query,
        key,
        value,
        tokens,
        sinks,
        spec=spec,
        with_lse=with_lse,
        seed=_dropout_words(spec, seed, query, split_axes),
        implementation=spec.implementation,
    )


def check_token_values(
    kv_mask=None, q_segment_ids=None, kv_segment_ids=None, q_positions=None, kv_positions=None,
    q_groups=None, kv_groups=None,
) -> None:  # fmt: skip
    """On every call where they can be read (``host_values``): per-token ids and positions that
    fit int32 (the kernels' type: a wider one would wrap into another segment or position), and
    no query in the segment kv_mask's padding keys take."""
    read = {
        name: check_int32_values(OP, name, values)
        for name, values in (
            ("q_segment_ids", q_segment_ids), ("kv_segment_ids", kv_segment_ids),
            ("q_positions", q_positions), ("kv_positions", kv_positions),
            ("q_groups", q_groups), ("kv_groups", kv_groups),
        )
        if values is not None
    }  # fmt: skip
    q_ids = read.get("q_segment_ids")
    if kv_mask is not None and q_ids is not None:
        require(
            not (q_ids == masking.KV_PADDING_SEGMENT).any(),
            f"{OP}: q_segment_ids holds {masking.KV_PADDING_SEGMENT}, the id kv_mask's padding "
            "keys take; a query with it would see them",
        )


def check_call(
    query,
    key,
    value,
    kv_mask=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    sinks=None,
    q_positions=None,
    kv_positions=None,
    q_groups=None,
    kv_groups=None,
    dropout_seed=None,
    causal: bool = False,
    sliding_window: int | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    dropout_rate: float = 0.0,
) -> None:
    """The ops' input check: the score options' value rules (``AttentionSpec``), then
    ``check_inputs``; dropout needs its seed."""
    AttentionSpec(
        causal=causal,
        sliding_window=sliding_window,
        softcap=softcap,
        scale=scale,
        dropout_rate=dropout_rate,
    )
    check_inputs(
        query, key, value, kv_mask, q_segment_ids, kv_segment_ids, sinks, q_positions,
        kv_positions, q_groups, kv_groups, dropout_seed,
    )  # fmt: skip
    require(
        not dropout_rate or dropout_seed is not None,
        f"{OP}: dropout_rate={dropout_rate} needs dropout_seed (an integer scalar: the same seed "
        "draws the same mask)",
    )


# Sharding: batch and heads split (query and kv heads together, so each shard keeps whole GQA
# groups); sequences and head_dim stay whole. A split sequence is context parallelism:
# ``ring.ring_attention`` over a ``cp`` axis.
_INPUTS = (
    "batch heads q_len head_dim, batch kv_heads kv_len head_dim, batch kv_heads kv_len value_dim, "
    "batch kv_len, batch q_len, batch kv_len, heads, "  # ..., sinks
    "batch q_len, batch kv_len, batch q_len, batch kv_len, "  # positions, groups
    ""  # dropout_seed (a scalar)
)
OUT = "batch heads q_len value_dim"
LSE = "batch heads q_len"
GRADIENTS = (
    "batch heads q_len head_dim, batch kv_heads kv_len head_dim, batch kv_heads kv_len value_dim"
)
"""dq, dk, dv: the factors of query, key and value."""
_RING = "context parallelism: flash_attention.ring.ring_attention over a 'cp' mesh axis"
RULE_OPTIONS = {
    "whole": ("q_len", "kv_len", "head_dim", "value_dim"),
    "together": (("heads", "kv_heads"),),
    "handled_by": {"q_len": _RING, "kv_len": _RING},
}
"""The factors every attention rule keeps whole or splits together (also ``dense_mask``'s)."""


def _rule(name: str, text: str):
    """The rule of ``name`` for a call's options: with dropout, batch and heads are ``located``
    (the mask hashes global indices, so a shard needs its offsets; DTensor does not split them)."""
    plain = ShardingRule.parse(name, text, **RULE_OPTIONS)
    dropping = ShardingRule.parse(name, text, located=("batch", "heads"), **RULE_OPTIONS)

    def rule(dropout_rate: float = 0.0, **_) -> ShardingRule:
        return dropping if dropout_rate else plain

    return rule


_QKV = ("query", "key", "value")
# The torch ops' 1.0 options follow the 1.0 tensors; tensors added since (sinks, positions,
# groups) and options added since come last, so positional calls written for 1.0 keep their
# meaning; dropout's seed and rate follow window_bounds_groups (1.3) for the same reason. Under
# ``torch.autocast`` query, key and value are cast to the autocast dtype, as autocast casts
# SDPA's inputs; masks and sinks keep theirs (scores and softmax run in f32).
_TORCH = {
    "torch_after": {"kv_segment_ids": TORCH_1_0, "kv_groups": ("window_bounds_groups",)},
    "autocast": _QKV,
    "jax_only": ("split_axes",),
}


@op(
    name="attention_forward_only",
    check=check_call,
    check_values=check_token_values,
    differentiable=(*_QKV, "sinks"),
    sharding=_rule("dot_product_attention", f"{_INPUTS} -> {OUT}"),
    **_TORCH,
)
@takes_options(AttentionSpec)
def dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    kv_mask: jax.Array | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    sinks: jax.Array | None = None,
    q_positions: jax.Array | None = None,
    kv_positions: jax.Array | None = None,
    q_groups: jax.Array | None = None,
    kv_groups: jax.Array | None = None,
    dropout_seed: jax.Array | None = None,
    *,
    split_axes: dict[str, tuple[str, ...]] | None = None,
    options: AttentionSpec,
) -> jax.Array:
    """softmax(scale * q k^T [soft-capped, masked]) v for q [B, Hq, Sq, D], k [B, Hkv, Sk, D],
    v [B, Hkv, Sk, Dv] (Dv may differ from D, as in MLA); the keyword options are the fields of
    ``AttentionSpec`` (see there).

    ``Hkv`` must divide ``Hq`` (grouped/multi-query attention; kv is not repeated). Queries align
    to the end of the keys (KV-cache decode). ``kv_mask`` [B, Sk] marks keys to attend;
    ``q_segment_ids`` [B, Sq] / ``kv_segment_ids`` [B, Sk] restrict attention to equal ids
    (packed sequences). ``sinks`` [Hq] adds one learnable logit per head to every softmax
    denominator (attention sinks, e.g. GPT-OSS), differentiable. ``q_positions`` [B, Sq] /
    ``kv_positions`` [B, Sk] replace the end-aligned indices in the causal/window rule (a cache
    prefilled at an offset); ``q_groups`` / ``kv_groups`` let tokens of one group >= 0 see each
    other whatever the rule (bidirectional image tokens; ``window_bounds_groups`` keeps the
    window on them too); see ``masking``. Rows with no visible key give zeros. ``dropout_rate``
    > 0 drops attention probabilities (scaling the kept ones by 1 / (1 - rate)) where
    ``dropout``'s hash of ``dropout_seed`` (an integer scalar) and (batch, query head, query,
    key) says, in the forward and again in the backward: the same seed draws the same mask.
    """
    return _attention(
        query, key, value, kv_mask, q_segment_ids, kv_segment_ids, sinks, q_positions,
        kv_positions, q_groups, kv_groups, dropout_seed, options=options, with_lse=False,
        split_axes=split_axes,
    )  # fmt: skip


@sharded(
    _rule(
        "attention_backward",
        # d_sinks ("heads") sums over batch and queries: with batch split, the boundary sums it
        # over the batch axes (a result lacking a split factor is summed, einsum-style).
        f"{_INPUTS}, {OUT}, {LSE}, {OUT}, {LSE} -> {GRADIENTS}, heads",
    )
)
@takes_options(AttentionSpec)
def attention_backward(
    query,
    key,
    value,
    kv_mask,
    q_segment_ids,
    kv_segment_ids,
    sinks,
    q_positions,
    kv_positions,
    q_groups,
    kv_groups,
    dropout_seed,
    out,
    lse,
    d_out,
    d_lse,
    *,
    split_axes: dict[str, tuple[str, ...]] | None = None,
    options: AttentionSpec,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """(dq, dk, dv, d_sinks) of ``dot_product_attention_with_lse`` from its saved outputs
    (d_sinks is None without sinks).

    The Pallas implementation reuses ``out`` and ``lse`` (no forward recompute); the others
    differentiate their forward.
    """
    spec = options.resolved(query.shape[-1])
    tokens = _prepare(
        query,
        key,
        kv_mask,
        q_segment_ids,
        kv_segment_ids,
        q_positions,
        kv_positions,
        q_groups,
        kv_groups,
    )
    seed = _dropout_words(spec, dropout_seed, query, split_axes)
    chosen = TABLE.select(
        query,
        key,
        value,
        tokens,
        sinks,
        spec=spec,
        with_lse=True,
        seed=seed,
        implementation=spec.implementation,
    )
    if chosen.name == "pallas":
        blocks = _kernel_blocks(query, key, value, tokens, spec)
        return pallas_tpu.attention_backward(
            query,
            key,
            value,
            tokens,
            sinks,
            out,
            lse,
            d_out,
            d_lse,
            spec,
            blocks,
            _interpret(),
            seed,
            spec.dropout_rate,
        )

    def forward(q, k, v, s):
        return chosen.fn(q, k, v, tokens, s, spec=spec, with_lse=True, seed=seed)

    _, pullback = jax.vjp(forward, query, key, value, sinks)
    return pullback((d_out, d_lse))


@op(
    name="attention_with_lse",
    check=check_call,
    check_values=check_token_values,
    differentiable=(*_QKV, "sinks"),
    sharding=_rule("dot_product_attention_with_lse", f"{_INPUTS} -> {OUT}, {LSE}"),
    # the backward reuses the forward's saved outputs instead of recomputing it
    jax_backward=SavedBackward(attention_backward, ("out", "lse", "d_out", "d_lse")),
    **_TORCH,
)
@takes_options(AttentionSpec)
def dot_product_attention_with_lse(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    kv_mask: jax.Array | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    sinks: jax.Array | None = None,
    q_positions: jax.Array | None = None,
    kv_positions: jax.Array | None = None,
    q_groups: jax.Array | None = None,
    kv_groups: jax.Array | None = None,
    dropout_seed: jax.Array | None = None,
    *,
    split_axes: dict[str, tuple[str, ...]] | None = None,
    options: AttentionSpec,
) -> tuple[jax.Array, jax.Array]:
    """``dot_product_attention`` plus the f32 logsumexp of each query's scores [B, Hq, Sq]
    (-inf for a row with no visible key). Differentiable in both outputs."""
    return _attention(
        query, key, value, kv_mask, q_segment_ids, kv_segment_ids, sinks, q_positions,
        kv_positions, q_groups, kv_groups, dropout_seed, options=options, with_lse=True,
        split_axes=split_axes,
    )  # fmt: skip
