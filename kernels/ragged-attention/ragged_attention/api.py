"""Public JAX API: ``ragged_attention`` and ``paged_attention``, forward only, with checks.

Implementations: ``pallas`` (this package's kernels; interpret mode on CPU) and ``xla`` (the
reference). Forward only: serving does not train. The Pallas kernels have no VJP (``jax.grad``
through them raises); the torch ops register no autograd.
"""

from __future__ import annotations

from dataclasses import fields

import jax
import jax.numpy as jnp
import numpy as np

from kernel_hub.kernel_api import (
    ShardingRule,
    check_dtype,
    check_rank,
    dtype_name,
    host_values,
    jax_default_device,
    jax_platform,
    op,
    pallas_and_xla,
    require,
    takes_options,
    tpu_generation,
)

from . import blocks as block_sizes
from . import kv_quant, pallas_paged, pallas_ragged, reference
from .options import PAGED_UNUSED, RAGGED_UNUSED, RaggedSpec

FLOAT_DTYPES = ("float32", "bfloat16", "float64")
INT_DTYPES = ("int32", "int64")


def _heads(op: str, q_heads: int, kv_heads: int) -> None:
    require(
        kv_heads > 0 and q_heads % kv_heads == 0,
        f"{op}: {kv_heads} kv heads must divide the {q_heads} query heads (grouped-query "
        f"attention); valid kv head counts: "
        f"{', '.join(str(d) for d in range(1, q_heads + 1) if q_heads % d == 0)}",
    )


def _sinks(op: str, sinks, q_heads: int) -> None:
    if sinks is not None:
        check_dtype(op, "sinks", sinks, FLOAT_DTYPES)
        require(
            tuple(sinks.shape) == (q_heads,),
            f"{op}: sinks has shape {tuple(sinks.shape)}; expected ({q_heads},), one per query "
            "head",
        )


def check_ragged_inputs(
    query,
    key,
    value,
    cu_seq_lens_q,
    cu_seq_lens_k,
    sinks=None,
    k_scales=None,
    v_scales=None,
) -> None:
    """Shape and dtype rules of ``ragged_attention`` (torch tensors or JAX arrays; the options
    check themselves, see ``RaggedSpec``)."""
    op = "ragged_attention"
    check_rank(op, "query", query, 3)
    check_rank(op, "key", key, 3)
    check_rank(op, "value", value, 3)
    check_dtype(op, "query", query, FLOAT_DTYPES)
    _kv_dtypes(op, ("key", "value"), query, key, value, k_scales, v_scales)
    _, q_heads, head_dim = query.shape
    num_keys, kv_heads, key_dim = key.shape
    require(
        key_dim == head_dim and tuple(value.shape) == tuple(key.shape),
        f"{op}: key {tuple(key.shape)} and value {tuple(value.shape)} must both be "
        f"[total_keys, kv_heads, head_dim={head_dim}]",
    )
    _scale_shapes(op, k_scales, v_scales, (kv_heads, num_keys), "[Hkv, total_keys]")
    _heads(op, q_heads, kv_heads)
    for name, cu in (("cu_seq_lens_q", cu_seq_lens_q), ("cu_seq_lens_k", cu_seq_lens_k)):
        check_rank(op, name, cu, 1)
        check_dtype(op, name, cu, INT_DTYPES)
    require(
        cu_seq_lens_q.shape[0] == cu_seq_lens_k.shape[0] >= 1,
        f"{op}: cu_seq_lens_q {tuple(cu_seq_lens_q.shape)} and cu_seq_lens_k "
        f"{tuple(cu_seq_lens_k.shape)} must both hold num_sequences + 1 >= 1 offsets",
    )
    _sinks(op, sinks, q_heads)


def check_ragged_values(cu_q, cu_k, num_tokens: int, num_keys: int, causal: bool) -> None:
    """Concrete offsets (numpy): start at 0, never decrease, fit the packed arrays, and with
    ``causal`` give no sequence more queries than keys."""
    op = "ragged_attention"
    cu_q, cu_k = np.asarray(cu_q), np.asarray(cu_k)
    for name, cu, limit in (("cu_seq_lens_q", cu_q, num_tokens), ("cu_seq_lens_k", cu_k, num_keys)):
        require(cu[0] == 0, f"{op}: {name} must start at 0, got {cu[0]}")
        steps = np.diff(cu)
        require(
            bool((steps >= 0).all()),
            f"{op}: {name} must not decrease; sequence {int(np.argmax(steps < 0))} has length "
            f"{int(steps[steps < 0][0]) if (steps < 0).any() else 0}",
        )
        require(cu[-1] <= limit, f"{op}: {name} ends at {cu[-1]}, past the {limit} packed tokens")
    if causal:
        longer = np.flatnonzero(np.diff(cu_q) > np.diff(cu_k))
        require(
            longer.size == 0,
            f"{op}: causal sequence {longer[0] if longer.size else 0} has more queries than keys "
            "(its queries are the last tokens of its keys)",
        )


def check_paged_inputs(
    query,
    k_pages,
    v_pages,
    block_table,
    kv_lens,
    sinks=None,
    k_scales=None,
    v_scales=None,
) -> None:
    """Shape and dtype rules of ``paged_attention``."""
    op = "paged_attention"
    check_rank(op, "query", query, 3)
    check_rank(op, "k_pages", k_pages, 4)
    check_rank(op, "v_pages", v_pages, 4)
    check_dtype(op, "query", query, FLOAT_DTYPES)
    _kv_dtypes(op, ("k_pages", "v_pages"), query, k_pages, v_pages, k_scales, v_scales)
    seqs, q_heads, head_dim = query.shape
    num_pages, page_size, kv_heads, page_dim = k_pages.shape
    require(
        tuple(v_pages.shape) == tuple(k_pages.shape),
        f"{op}: v_pages {tuple(v_pages.shape)} must match k_pages {tuple(k_pages.shape)}",
    )
    require(num_pages >= 1 and page_size >= 1, f"{op}: empty cache pages {tuple(k_pages.shape)}")
    require(
        page_dim == head_dim,
        f"{op}: pages {tuple(k_pages.shape)} are [P, page, Hkv, D] with D={page_dim}, but the "
        f"query's head_dim is {head_dim}",
    )
    _scale_shapes(op, k_scales, v_scales, (num_pages, kv_heads, page_size), "[P, Hkv, page]")
    _heads(op, q_heads, kv_heads)
    check_rank(op, "block_table", block_table, 2)
    check_dtype(op, "block_table", block_table, INT_DTYPES)
    check_rank(op, "kv_lens", kv_lens, 1)
    check_dtype(op, "kv_lens", kv_lens, INT_DTYPES)
    require(
        block_table.shape[0] == seqs == kv_lens.shape[0] and block_table.shape[1] >= 1,
        f"{op}: query has {seqs} sequences (one token each); block_table "
        f"{tuple(block_table.shape)} must be [{seqs}, max_pages >= 1] and kv_lens "
        f"{tuple(kv_lens.shape)} [{seqs}]",
    )
    _sinks(op, sinks, q_heads)


def _kv_dtypes(op: str, names, query, key, value, k_scales, v_scales) -> None:
    """K/V in the query's dtype without scales, or 8-bit (``kv_quant``) with both scales."""
    q_name, k_name, v_name = (dtype_name(a.dtype) for a in (query, key, value))
    require(
        k_name == v_name,
        f"{op}: {names[0]} are {k_name} but {names[1]} are {v_name}; they must share a dtype",
    )
    valid = (
        f"valid {names[0]} dtypes: the query's ({q_name}) without scales, or "
        f"{', '.join(kv_quant.KV_CACHE_DTYPES)} with k_scales and v_scales "
        f"({kv_quant.SCALE_DTYPE})"
    )
    scaled = (k_scales is not None, v_scales is not None)
    if kv_quant.is_quantized(k_name):
        require(all(scaled), f"{op}: {k_name} {names[0]} need k_scales and v_scales; {valid}")
        for name, scales in (("k_scales", k_scales), ("v_scales", v_scales)):
            check_dtype(op, name, scales, (kv_quant.SCALE_DTYPE,))
    else:
        require(k_name == q_name, f"{op}: {names[0]} are {k_name}, the query {q_name}; {valid}")
        require(not any(scaled), f"{op}: scales came with {k_name} {names[0]}; {valid}")


def _scale_shapes(op: str, k_scales, v_scales, shape: tuple, layout: str) -> None:
    for name, scales in (("k_scales", k_scales), ("v_scales", v_scales)):
        require(
            scales is None or tuple(scales.shape) == shape,
            f"{op}: {name} {tuple(scales.shape) if scales is not None else ()} must be "
            f"{layout} = {shape}, one scale per cached token and kv head",
        )


def check_paged_values(block_table, kv_lens, num_pages: int, page_size: int) -> None:
    """Concrete tables (numpy): every page a sequence's length needs is a real page id."""
    op = "paged_attention"
    table, lens = np.asarray(block_table), np.asarray(kv_lens)
    require(bool((lens >= 0).all()), f"{op}: kv_lens must be >= 0, got {lens.min()}")
    needed = -(-lens // page_size)
    too_long = np.flatnonzero(needed > table.shape[1])
    require(
        too_long.size == 0,
        f"{op}: sequence {too_long[0] if too_long.size else 0} has "
        f"{lens[too_long[0]] if too_long.size else 0} keys, more than its "
        f"{table.shape[1]} table entries x page_size {page_size} can hold",
    )
    used = np.arange(table.shape[1])[None, :] < needed[:, None]
    bad = used & ((table < 0) | (table >= num_pages))
    if bad.any():
        s, j = (int(i[0]) for i in np.nonzero(bad))
        raise_msg = (
            f"{op}: block_table[{s}, {j}] = {int(table[s, j])} points past the cache (valid page "
            f"ids: 0..{num_pages - 1}); sequence {s} needs {int(needed[s])} pages for its "
            f"{int(lens[s])} keys, -1 is allowed only after them"
        )
        require(False, raise_msg)


def _interpret() -> bool:
    return jax_platform() == "cpu"


def _generation() -> str | None:
    device = jax_default_device()
    return tpu_generation(device) if device.platform == "tpu" else None


# --------------------------------------------------------------------------------------------
# ragged_attention implementations: fn(q, k, v, cu_q, cu_k, sinks, k_scales, v_scales, *, spec),
# ``spec`` resolved


def _ragged_blocks(q, spec: RaggedSpec) -> pallas_ragged.RaggedBlocks:
    default = block_sizes.ragged_blocks(_generation(), q.dtype.name, interpret=_interpret())
    return pallas_ragged.RaggedBlocks(  # 0 is a block size (refused), not "the default"
        default.q if spec.block_q is None else spec.block_q,
        default.k if spec.block_k is None else spec.block_k,
    )


def _ragged_pallas(q, k, v, cu_q, cu_k, sinks, k_scales, v_scales, *, spec):
    blocks = _ragged_blocks(q, spec)
    return pallas_ragged.ragged_attention(
        q, k, v, cu_q, cu_k, sinks, spec, blocks, _interpret(), k_scales, v_scales
    )


def _ragged_pallas_problem(q, k, v, cu_q, cu_k, sinks, k_scales, v_scales, *, spec):
    if q.dtype == jnp.float64 and not _interpret():
        return "float64 runs only in interpret mode (CPU)"
    blocks = _ragged_blocks(q, spec)
    return pallas_ragged.blocks_problem(q.shape, k.shape, q.dtype, blocks, interpret=_interpret())


def _ragged_xla(q, k, v, cu_q, cu_k, sinks, k_scales, v_scales, *, spec):
    return reference.ragged_attention(q, k, v, cu_q, cu_k, sinks, spec, k_scales, v_scales)


RAGGED_TABLE = pallas_and_xla(
    "ragged_attention", _ragged_pallas, _ragged_xla, _ragged_pallas_problem
)


# --------------------------------------------------------------------------------------------
# paged_attention implementations: fn(q, k_pages, v_pages, table, lens, sinks, k_scales,
# v_scales, *, spec)


def _paged_blocks(k_pages, block_table, spec: RaggedSpec) -> pallas_paged.PagedBlocks:
    if spec.pages_per_block is not None:
        return pallas_paged.PagedBlocks(spec.pages_per_block)
    return block_sizes.paged_blocks(k_pages.shape[1], block_table.shape[1], interpret=_interpret())


def _paged_pallas(q, k_pages, v_pages, table, lens, sinks, k_scales, v_scales, *, spec):
    blocks = _paged_blocks(k_pages, table, spec)
    return pallas_paged.paged_attention(
        q, k_pages, v_pages, table, lens, sinks, spec, blocks, _interpret(), k_scales, v_scales
    )


def _paged_pallas_problem(q, k_pages, v_pages, table, lens, sinks, k_scales, v_scales, *, spec):
    if q.dtype == jnp.float64 and not _interpret():
        return "float64 runs only in interpret mode (CPU)"
    blocks = _paged_blocks(k_pages, table, spec)
    return pallas_paged.blocks_problem(
        q.shape, k_pages.shape, k_pages.dtype, blocks, interpret=_interpret()
    )


def _paged_xla(q, k_pages, v_pages, table, lens, sinks, k_scales, v_scales, *, spec):
    return reference.paged_attention(
        q, k_pages, v_pages, table, lens, sinks, spec, k_scales, v_scales
    )


PAGED_TABLE = pallas_and_xla("paged_attention", _paged_pallas, _paged_xla, _paged_pallas_problem)


def _check_ragged_call(
    query, key, value, cu_seq_lens_q, cu_seq_lens_k, sinks=None, k_scales=None, v_scales=None,
    sliding_window=None, softcap=None, scale=None,
) -> None:  # fmt: skip
    """``ragged_attention``'s check: the score options' value rules, then the inputs."""
    RaggedSpec(sliding_window=sliding_window, softcap=softcap, scale=scale)
    check_ragged_inputs(query, key, value, cu_seq_lens_q, cu_seq_lens_k, sinks, k_scales, v_scales)


def _check_ragged_offsets(query, key, cu_seq_lens_q, cu_seq_lens_k, causal=True) -> None:
    """On every call where they can be read (``host_values``): the offsets' values."""
    cu_q, cu_k = host_values(cu_seq_lens_q), host_values(cu_seq_lens_k)
    if cu_q is not None and cu_k is not None:
        check_ragged_values(cu_q, cu_k, query.shape[0], key.shape[0], causal)


def _check_paged_call(
    query, k_pages, v_pages, block_table, kv_lens, sinks=None, k_scales=None, v_scales=None,
    sliding_window=None, softcap=None, scale=None,
) -> None:  # fmt: skip
    """``paged_attention``'s check: the score options' value rules, then the inputs."""
    RaggedSpec(sliding_window=sliding_window, softcap=softcap, scale=scale)
    check_paged_inputs(query, k_pages, v_pages, block_table, kv_lens, sinks, k_scales, v_scales)


def _check_block_table(k_pages, block_table, kv_lens) -> None:
    """On every call where they can be read (``host_values``): the block table's values."""
    table, lens = host_values(block_table), host_values(kv_lens)
    if table is not None and lens is not None:
        check_paged_values(table, lens, k_pages.shape[0], k_pages.shape[1])


# Sharding: query heads split with their kv heads (each shard keeps whole GQA groups and its slice
# of the sinks); packed tokens, keys and their offsets stay whole (a sequence's rows must sit with
# its offsets), and so do pages (the block table holds global page ids). Paged decode may also
# split its sequences: each shard reads its sequences' pages from the whole cache. An 8-bit
# cache's scales ([Hkv, N] ragged, [P, Hkv, page] paged) follow their heads.
_DIMS = ("head_dim", "value_dim")
_WHOLE_SEQUENCES = "data parallelism over whole sequences (one ragged batch per shard)"
# The torch ops (the raw ops under ``torch_api``'s bucketing entry points) take each op's options
# right after ``sinks`` (their 1.0 positions), the 8-bit K/V scales (1.1) last.
_RAGGED_OPTIONS = tuple(f.name for f in fields(RaggedSpec) if f.name not in RAGGED_UNUSED)
_PAGED_OPTIONS = tuple(f.name for f in fields(RaggedSpec) if f.name not in PAGED_UNUSED)


@op(
    name="ragged_attention_op",
    check=_check_ragged_call,
    check_values=_check_ragged_offsets,
    sharding=ShardingRule.parse(
        "ragged_attention",
        "tokens heads head_dim, keys kv_heads head_dim, keys kv_heads value_dim, offsets, "
        "offsets, heads, kv_heads keys, kv_heads keys -> tokens heads value_dim",
        whole=("tokens", "keys", "offsets", *_DIMS),
        together=(("heads", "kv_heads"),),
        handled_by={"tokens": _WHOLE_SEQUENCES, "keys": _WHOLE_SEQUENCES},
    ),
    torch_after={"sinks": _RAGGED_OPTIONS},
)
@takes_options(RaggedSpec, exclude=RAGGED_UNUSED)
def ragged_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    cu_seq_lens_q: jax.Array,
    cu_seq_lens_k: jax.Array,
    sinks: jax.Array | None = None,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    *,
    options: RaggedSpec,
) -> jax.Array:
    """Attention over packed sequences: q [T, Hq, D], k/v [N, Hkv, D], offsets
    ``cu_seq_lens_q/k`` [S+1] -> [T, Hq, D]; see ``masking`` for which pairs attend. The keyword
    options are ``RaggedSpec``'s fields (see there) less ``pages_per_block``.

    k/v in q's dtype, or 8-bit (float8_e4m3fn, int8: an 8-bit cache read back, ``kv_quant``)
    with ``k_scales``/``v_scales`` f32 [Hkv, N], one per key and kv head, dequantized inside the
    kernel.

    ``sinks`` [Hq] adds exp(sink) to each query's softmax denominator (attention sinks).
    """
    spec = options.resolved(query.shape[-1])
    cu_q = jnp.asarray(cu_seq_lens_q, jnp.int32)
    cu_k = jnp.asarray(cu_seq_lens_k, jnp.int32)
    return RAGGED_TABLE(
        query,
        key,
        value,
        cu_q,
        cu_k,
        sinks,
        k_scales,
        v_scales,
        spec=spec,
        implementation=spec.implementation,
    )


@op(
    name="paged_attention_op",
    check=_check_paged_call,
    check_values=_check_block_table,
    sharding=ShardingRule.parse(
        "paged_attention",
        "seqs heads head_dim, pages page kv_heads head_dim, pages page kv_heads value_dim, "
        "seqs max_pages, seqs, heads, pages kv_heads page, pages kv_heads page -> "
        "seqs heads value_dim",
        whole=("pages", "page", "max_pages", *_DIMS),
        together=(("heads", "kv_heads"),),
        handled_by={"pages": "a cache per shard with shard-local page ids (not implemented)"},
    ),
    torch_after={"sinks": _PAGED_OPTIONS},
)
@takes_options(RaggedSpec, exclude=PAGED_UNUSED)
def paged_attention(
    query: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_table: jax.Array,
    kv_lens: jax.Array,
    sinks: jax.Array | None = None,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    *,
    options: RaggedSpec,
) -> jax.Array:
    """Decode attention over a paged cache: one query per sequence, q [S, Hq, D]; pages
    [P, page, Hkv, D] (one layer's page views of Transformers' cache) in q's dtype, or 8-bit
    (float8_e4m3fn, int8) with ``k_scales``/``v_scales`` f32 [P, Hkv, page], one scale per
    cached token and kv head (``kv_quant``: dequantized inside the kernel);
    ``block_table`` [S, max_pages] page ids (-1 after the pages in use); ``kv_lens`` [S] keys
    per sequence, the new token included (0: a padding sequence, zero output) -> [S, Hq, D].
    The keyword options are ``RaggedSpec``'s fields (see there) less ``causal`` (decode is
    causal), ``block_q`` and ``block_k``.
    """
    spec = options.resolved(query.shape[-1])
    table = jnp.asarray(block_table, jnp.int32)
    lens = jnp.asarray(kv_lens, jnp.int32)
    return PAGED_TABLE(
        query,
        k_pages,
        v_pages,
        table,
        lens,
        sinks,
        k_scales,
        v_scales,
        spec=spec,
        implementation=spec.implementation,
    )
