"""Pallas flash attention for TPU: blocked online softmax, forward and backward (dq; dk and dv).

Grouped-query layout: the ``G = Hq // Hkv`` query heads that share a kv head are packed into the
rows of one array, q [B, Hq, Sq, D] -> [B, Hkv, G * Sq, D] (row ``g * Sq + i`` is query ``i`` of
head ``g`` of the group). The grid's head axis is the kv head, so kv is never repeated, each kv
block is read once for all G heads (what makes decode with few queries cheap), and dk/dv need no
reduction over heads afterwards.

The forward returns the logsumexp per query; the backward reuses it (no forward recompute). Per-row
statistics (the logsumexp, the backward's delta) live in HBM lane-dense, one ``[1, block_q]`` row
per q block, and are turned between rows and columns in VMEM (``_as_lanes``, ``_as_column``): a
``[rows, 1]`` column would take a 128-lane tile per row in HBM (256 MiB for 2 MiB of logsumexp at
batch 2 x 8192 with Llama-3-8B heads).
Attention sinks (a per-head logit in every row's softmax denominator) join the forward's final
normalisation; the backward kernels need nothing else (the sink is in the logsumexp), and the
sinks' gradient is a reduction of the logsumexp and the row statistics outside the kernels.
Values may have their own head dim (``Dv``, e.g. MLA's 128 against q/k's 192).
Kv blocks no query of a q block can see (causal, sliding window) are skipped, and the kv index map
is clamped to the visible range so skipped steps fetch nothing new. Per-token mask arrays
(``masking.TokenMask``: segment ids, positions, groups) come in blocks beside q and kv; a block pair
whose id, position or group ranges cannot meet (all-padding key blocks, another packed sequence,
another chunk, a causal future) is skipped too, decided from those blocks' minima and maxima, so
no mask larger than O(S) exists anywhere. As that range depends on the data, an XLA pre-pass
(``_block_ranges``) evaluates the same block test for every block pair and hands each q block's
first and last visible kv block (and each kv block's first and last q block, for dk/dv) to the
kernels as scalar-prefetch operands: the index maps clamp to them, so blocks outside are neither
computed nor fetched from HBM.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernel_hub.kernel_api import tiling

from . import dropout, masking
from .masking import AttentionSpec, TokenMask

# Score given to masked entries while tracking the running row maximum: finite, so a row with no
# visible key so far keeps exp(m_prev - m_new) = 1 instead of NaN.
_MASK_VALUE = -1e30
_VMEM_RESERVE = 6 << 20
"""VMEM left to Mosaic's own scratch beside the blocks' estimate."""
# Fits v4's default scoped VMEM (16 MiB) with room for Mosaic's own scratch.
VMEM_BUDGET_BYTES = tiling.vmem_budget(reserve=_VMEM_RESERVE)
_LANES = 128
_MAX_BLOCK_Q = 512
_BLOCK_K_CHOICES = (2048, 1024, 512, 256, 128)
_EVERY_PAIR_FORWARD = tuple(
    (block_q, block_k) for block_q in (2048, 1024) for block_k in (512, 256)
)
"""Forward blocks tried first, within the generation's VMEM, when the call visits every block
pair (no causal or window rule, no per-token mask): the forward fetches K and V once per q
block, so a q block of 2,048 rows (1,536 at Flux's 4,608 tokens, see ``unpadded``) reads them
3 times where 512-row blocks read them 9 times, at the same FLOPs (with a mask the block
schedule skips, larger q blocks would compute more of the diagonal's masked tiles). The kv
block stays at most 512 keys: the bytes do not depend on it, the score tiles' VMEM does."""
_EVERY_PAIR_BACKWARD = ((1024, 1024),)
"""The same for the backward's shared blocks: dq fetches K and V once per q block and dk/dv
fetch q and dO once per kv block, so both axes grow together (a larger q block with a smaller
kv block would move more bytes in dk/dv than it saves in dq)."""
_INTERPRET_BLOCK = 2048


def _div(a, b: int):
    """``a // b`` for non-negative traced ints, as a plain truncating division.

    jnp's floor division adds sign fix-ups whose Mosaic lowering asks which chip it targets; the
    indices here are never negative, so truncation is the same and lowers anywhere.
    """
    return jax.lax.div(a, jnp.asarray(b, a.dtype) if hasattr(a, "dtype") else b)


def _rem(a, b: int):
    """``a % b`` for non-negative traced ints (see ``_div``)."""
    return jax.lax.rem(a, jnp.asarray(b, a.dtype) if hasattr(a, "dtype") else b)


@dataclass(frozen=True)
class BlockSizes:
    """Block sizes of one kernel: ``q`` packed query rows, ``k`` keys. Powers of two when a
    user gives them; the defaults may be other multiples of 128 (``unpadded``)."""

    q: int
    k: int


@dataclass(frozen=True)
class KernelBlocks:
    """Block sizes for the forward and for both backward kernels."""

    forward: BlockSizes
    backward: BlockSizes


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class Layout:
    """Static geometry of one call: packed query rows, padding and blocks."""

    batch: int
    kv_heads: int
    groups: int
    q_len: int
    kv_len: int
    head_dim: int
    value_dim: int
    q_len_padded: int
    block_q: int
    kv_len_padded: int
    block_k: int
    whole_groups: bool
    """A q block holds whole groups of ``q_len_padded`` rows (small q_len, e.g. decode)."""

    @property
    def rows(self) -> int:
        return self.groups * self.q_len_padded

    @property
    def num_q_blocks(self) -> int:
        return self.rows // self.block_q

    @property
    def num_k_blocks(self) -> int:
        return self.kv_len_padded // self.block_k

    @property
    def num_token_blocks(self) -> int:
        """q blocks of the per-token q arrays (one head's queries, or all packed rows when q
        blocks hold whole groups; see ``_pack_pair``): q block ``qi`` reads token block
        ``qi % num_token_blocks``."""
        return self.num_q_blocks if self.whole_groups else self.q_len_padded // self.block_q

    def query_index(self, qi, shape):
        """Query index (0..q_len_padded) of each row of q block ``qi``, as an int32 array."""
        row = jax.lax.broadcasted_iota(jnp.int32, shape, 0)
        if self.whole_groups:
            return _rem(row, self.q_len_padded)
        first = _rem(qi, self.q_len_padded // self.block_q) * self.block_q
        return first + row

    def query_range(self, qi):
        """(first, last) real query index in q block ``qi``; last < first if it is all padding."""
        if self.whole_groups:
            return 0, self.q_len - 1
        first = _rem(qi, self.q_len_padded // self.block_q) * self.block_q
        return first, jnp.minimum(first + self.block_q - 1, self.q_len - 1)

    def key_block_range(self, qi, spec: AttentionSpec):
        """(lo, hi) kv block indices q block ``qi`` must visit; hi < lo when none."""
        q_first, q_last = self.query_range(qi)
        k_first, k_last = masking.key_range(q_first, q_last, self.q_len, self.kv_len, spec)
        lo = _div(jnp.maximum(k_first, 0), self.block_k)
        empty = (k_last < k_first) | (q_last < q_first)
        hi = jnp.where(empty, -1, _div(jnp.maximum(k_last, 0), self.block_k))
        return lo, hi

    def visible(self, qi, ki, spec: AttentionSpec):
        lo, hi = self.key_block_range(qi, spec)
        return (ki >= lo) & (ki <= hi)

    def clamped_key_block(self, qi, ki, spec: AttentionSpec):
        """``ki`` clamped to the visible range: a skipped step re-uses the block already fetched."""
        return _clamp(ki, *self.key_block_range(qi, spec), self.num_k_blocks)

    def clamped_query_block(self, qi, ki, spec: AttentionSpec):
        """``qi`` clamped to the q blocks of its group that can see kv block ``ki``."""
        if self.whole_groups:
            return qi
        per_group = self.q_len_padded // self.block_q
        k_first = ki * self.block_k
        k_last = jnp.minimum(k_first + self.block_k - 1, self.kv_len - 1)
        q_first, q_last = masking.query_range(k_first, k_last, self.q_len, self.kv_len, spec)
        lo = _div(jnp.clip(q_first, 0, self.q_len - 1), self.block_q)
        hi = _div(jnp.clip(q_last, 0, self.q_len - 1), self.block_q)
        group_start = _div(qi, per_group) * per_group
        return group_start + jnp.clip(_rem(qi, per_group), lo, jnp.maximum(hi, lo))


def _clamp(index, lo, hi, count: int):
    """``index`` clamped to [lo, hi] (to ``lo`` when the range is empty, hi < lo)."""
    return jnp.clip(index, jnp.minimum(lo, count - 1), jnp.maximum(hi, lo))


def make_layout(q_shape, kv_shape, blocks: BlockSizes, value_dim: int | None = None) -> Layout:
    """Pad and block the packed query rows and the keys (see the module docstring)."""
    batch, q_heads, q_len, head_dim = q_shape
    _, kv_heads, kv_len, _ = kv_shape
    groups = q_heads // kv_heads
    rows = groups * q_len
    whole_groups = True
    if rows <= blocks.q:
        q_len_padded, block_q = q_len, rows
    elif _next_power_of_two(q_len) < blocks.q:
        q_len_padded = max(_next_power_of_two(q_len), min(16, blocks.q))
        per_block = max(
            d for d in range(1, groups + 1) if groups % d == 0 and d * q_len_padded <= blocks.q
        )
        block_q = per_block * q_len_padded
    else:
        whole_groups = False
        q_len_padded, block_q = _round_up(q_len, blocks.q), blocks.q
    if kv_len <= blocks.k:
        kv_len_padded, block_k = kv_len, kv_len
    else:
        kv_len_padded, block_k = _round_up(kv_len, blocks.k), blocks.k
    return Layout(
        batch=batch,
        kv_heads=kv_heads,
        groups=groups,
        q_len=q_len,
        kv_len=kv_len,
        head_dim=head_dim,
        value_dim=head_dim if value_dim is None else value_dim,
        q_len_padded=q_len_padded,
        block_q=block_q,
        kv_len_padded=kv_len_padded,
        block_k=block_k,
        whole_groups=whole_groups,
    )


@dataclass(frozen=True)
class SequenceMinor:
    """Which of K and V the forward reads transposed, ``[B, Hkv, D, Sk]`` in ``[D, bk]`` blocks.

    TPU lays out a ``[.., S, D]`` array whose D pads more of its 128-lane tiles than S would
    sequence-minor (``{2,3,1,0}``), and a decode step's cache arrives so (gpt-oss-20b's
    ``bf16[64,8,4096,64]``). Read ``[bk, D]``, XLA copied the whole cache into the padded D-minor
    layout and back in every layer; read transposed, the transpose is a bitcast of the cache."""

    keys: bool = False
    values: bool = False


def _fewer_lanes_sequence_minor(length: int, dim: int) -> bool:
    """Whether ``[.., length, dim]`` pads fewer lanes sequence-minor: the layout TPU gives such
    an array (deviceless libtpu, ``entry_computation_layout``: ``[64, 8, 4096, 64]``,
    ``[8, 8, 300, 192]`` sequence-minor; ``[.., 4096, 128]``, ``[8, 8, 64, 64]`` not)."""
    return _round_up(length, _LANES) * dim < _round_up(dim, _LANES) * length


def sequence_minor(layout: Layout) -> SequenceMinor:
    """How the forward reads K and V: sequence-minor where TPU lays them out so, for a cache
    (fewer queries than keys). The backward kernels read ``[bk, D]``: a program differentiating
    through a cache copies it for them as it did for the forward before (one relayout either
    way); keys computed in the program with fewer queries than keys (cross-attention) would be
    laid out twice."""
    if layout.q_len >= layout.kv_len:
        return SequenceMinor()
    return SequenceMinor(
        keys=_fewer_lanes_sequence_minor(layout.kv_len, layout.head_dim),
        values=_fewer_lanes_sequence_minor(layout.kv_len, layout.value_dim),
    )


def _forward_vmem_bytes(block_q: int, block_k: int, dims: tuple[int, int], itemsize: int) -> int:
    d, dv = dims
    streamed = 2 * (block_q * (d + dv) + block_k * (d + dv)) * itemsize  # q, o, k, v
    row_stats = 4 * block_q * _LANES * 4  # sinks (2 buffers), m, l (lane padded)
    lse = 2 * 8 * block_q * 4 + 2 * block_q * _LANES * 4  # out rows (2 buffers), _as_lanes
    return streamed + row_stats + lse + block_q * dv * 4 + 4 * block_q * block_k * 4


def _backward_vmem_bytes(block_q: int, block_k: int, dims: tuple[int, int], itemsize: int) -> int:
    d, dv = dims
    # q, do, k, v, dk, dv
    streamed = 2 * (block_q * (d + dv) + 2 * block_k * (d + dv)) * itemsize
    row_stats = 4 * 8 * block_q * 4 + 4 * block_q * _LANES * 4  # lse, delta rows; _as_column
    return streamed + row_stats + block_k * (d + dv) * 4 + 6 * block_q * block_k * 4


def _largest_fitting(
    rows: int, kv_len: int, dims: tuple[int, int], itemsize: int, vmem_bytes
) -> BlockSizes:
    """The largest q block, then the largest kv block not past the (lane-padded) keys, that fit
    v4's budget; the smallest pair when none does."""
    padded_keys = _round_up(kv_len, _LANES)
    candidates = [
        (block_q, block_k)
        for block_q in (_MAX_BLOCK_Q, _MAX_BLOCK_Q // 2, _MAX_BLOCK_Q // 4)
        for block_k in _BLOCK_K_CHOICES
        if block_k <= padded_keys or block_k == _BLOCK_K_CHOICES[-1]
    ]
    fitting = _first_fitting(
        candidates, rows, kv_len, dims, itemsize, vmem_bytes, VMEM_BUDGET_BYTES
    )
    return fitting or BlockSizes(_MAX_BLOCK_Q // 4, _BLOCK_K_CHOICES[-1])


def _first_fitting(
    candidates, rows: int, kv_len: int, dims: tuple[int, int], itemsize: int, vmem_bytes, budget
) -> BlockSizes | None:
    """The first (block_q, block_k) of ``candidates`` whose blocks (whole rows or keys when
    fewer) fit ``budget``, or None."""
    for block_q, block_k in candidates:
        q, k = min(block_q, rows), min(block_k, _round_up(kv_len, _LANES))
        if vmem_bytes(q, k, dims, itemsize) <= budget:
            return BlockSizes(block_q, block_k)
    return None


def default_blocks(
    q_shape,
    kv_shape,
    dtype,
    *,
    interpret: bool,
    value_dim: int | None = None,
    generation: str | None = None,
    every_pair: bool = False,
) -> KernelBlocks:
    """Largest blocks that fit the VMEM budget; few, big blocks in interpret mode (CPU). A call
    that visits ``every_pair`` of blocks first tries ``_EVERY_PAIR_FORWARD`` and
    ``_EVERY_PAIR_BACKWARD`` within ``generation``'s VMEM (v4's without one)."""
    if interpret:
        big = BlockSizes(_INTERPRET_BLOCK, _INTERPRET_BLOCK)
        return KernelBlocks(big, big)
    _, q_heads, q_len, head_dim = q_shape
    _, kv_heads, kv_len, _ = kv_shape
    rows = q_heads // kv_heads * q_len
    itemsize = jnp.dtype(dtype).itemsize
    dims = (head_dim, head_dim if value_dim is None else value_dim)
    budget = tiling.vmem_budget(generation, reserve=_VMEM_RESERVE)
    blocks = []
    for grown, vmem_bytes in (
        (_EVERY_PAIR_FORWARD, _forward_vmem_bytes),
        (_EVERY_PAIR_BACKWARD, _backward_vmem_bytes),
    ):
        # (rows that fit one 512-row block gain nothing: they are read once already)
        chosen = (
            every_pair
            and rows > _MAX_BLOCK_Q
            and _first_fitting(grown, rows, kv_len, dims, itemsize, vmem_bytes, budget)
        )
        blocks.append(chosen or _largest_fitting(rows, kv_len, dims, itemsize, vmem_bytes))
    return KernelBlocks(*blocks)


def _vmem_limit(need: int) -> int | None:
    """Mosaic's scoped VMEM limit for blocks needing ``need`` bytes: the default (None) when
    they fit v4's budget, else the estimate plus the reserve (``default_blocks`` planned it
    within the generation's VMEM)."""
    return None if need <= VMEM_BUDGET_BYTES else need + _VMEM_RESERVE


def _dividing(length: int, cap: int) -> int:
    """The largest multiple of 128 that divides ``length``, at most ``cap`` and at least half
    of it; ``cap`` when there is none (the length is then padded to a multiple of ``cap``)."""
    if length <= cap or length % _LANES:
        return cap
    for size in range(cap - cap % _LANES, cap // 2 - 1, -_LANES):
        if size and length % size == 0:
            return size
    return cap


def unpadded(blocks: KernelBlocks, q_len: int, kv_len: int) -> KernelBlocks:
    """``blocks`` shrunk, where a multiple of 128 lanes of at least half their size divides
    the sequence, to one that does: no padded rows or keys are copied, fetched or computed
    (Flux at 1024 x 1024 px: 4,608 tokens; at 256 x 256 px: 768, padded to 1,024 by 512-row
    blocks)."""

    def fit(b: BlockSizes) -> BlockSizes:
        return BlockSizes(_dividing(q_len, b.q), _dividing(kv_len, b.k))

    return KernelBlocks(fit(blocks.forward), fit(blocks.backward))


def blocks_problem(q_shape, kv_shape, dtype, blocks: BlockSizes, *, interpret: bool) -> str | None:
    """Why user block sizes cannot be used, or None. TPU tiling rules apply unless interpreting."""
    for name, size in (("block_q", blocks.q), ("block_k", blocks.k)):
        if size < 8 or size & (size - 1):
            return f"{name}={size} must be a power of two >= 8"
    if interpret:
        return None
    if blocks.q < tiling.sublane_multiple(dtype):
        minimum = tiling.sublane_multiple(dtype)
        return f"block_q={blocks.q} must be at least {minimum} for {jnp.dtype(dtype).name}"
    kv_len = kv_shape[2]
    if blocks.k < kv_len and blocks.k % _LANES:
        return f"block_k={blocks.k} must be a multiple of {_LANES} (or cover all {kv_len} keys)"
    return None


# --------------------------------------------------------------------------------------------
# Packing between the [B, H, S, D] API layout and the kernels' [B, Hkv, rows, D] layout.

_FIELDS = ("segments", "positions", "groups")
"""Per-token inputs a kernel may take, each as a (q [B, rows, 1], kv [B, 1, Sk_padded]) pair."""
_NO_GROUP = -1


def _pack_rows(x, layout: Layout):
    """[B, Hq, Sq, ...] -> [B, Hkv, G * Sq_padded, ...], zero padded."""
    pad = layout.q_len_padded - layout.q_len
    if pad:
        x = jnp.pad(x, [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 3))
    return x.reshape(layout.batch, layout.kv_heads, layout.rows, *x.shape[3:])


def _unpack_rows(x, layout: Layout):
    x = x.reshape(layout.batch, layout.kv_heads * layout.groups, layout.q_len_padded, *x.shape[3:])
    return x[:, :, : layout.q_len]


def _pad_keys(x, layout: Layout):
    pad = layout.kv_len_padded - layout.kv_len
    return jnp.pad(x, [(0, 0), (0, 0), (0, pad), (0, 0)]) if pad else x


def _pack_sinks(sinks, layout: Layout, dtype):
    """Sinks [Hq] -> [Hkv, rows, 1] in the accumulation ``dtype``, one logit per packed row."""
    per_head = sinks.astype(dtype).reshape(layout.kv_heads, layout.groups, 1)
    rows = jnp.broadcast_to(per_head, (layout.kv_heads, layout.groups, layout.q_len_padded))
    return rows.reshape(layout.kv_heads, layout.rows, 1)


def _pad(x, pad: int, fill):
    x = x.astype(jnp.int32)
    if not pad:
        return x
    if fill == "edge":
        return jnp.pad(x, [(0, 0), (0, pad)], mode="edge")
    return jnp.pad(x, [(0, 0), (0, pad)], constant_values=fill)


def _pack_pair(q_values, kv_values, layout: Layout, q_fill, kv_fill):
    """q values -> [B, Sq_padded, 1] (a q block of one head's rows reads its queries' block,
    see ``_specs``), or [B, rows, 1] when q blocks hold whole groups (short q: one value per
    packed row); kv values -> [B, 1, Sk_padded]."""
    q = _pad(q_values, layout.q_len_padded - layout.q_len, q_fill)
    if layout.whole_groups:
        q = jnp.tile(q, (1, layout.groups))
    q = q[:, :, None]
    kv = _pad(kv_values, layout.kv_len_padded - layout.kv_len, kv_fill)
    return q, kv[:, None, :]


def _pack_tokens(tokens: TokenMask | None, layout: Layout) -> tuple[tuple[str, ...], tuple]:
    """(fields present, their packed arrays in ``_FIELDS`` order, q then kv for each).

    Padding rows and keys get fills that widen no block's range: key padding's segment id,
    positions of the last real token, no group."""
    if tokens is None:
        return (), ()
    pairs = {
        "segments": (tokens.q_segment_ids, tokens.kv_segment_ids, 0, masking.KV_PADDING_SEGMENT),
        "positions": (tokens.q_positions, tokens.kv_positions, "edge", "edge"),
        "groups": (tokens.q_groups, tokens.kv_groups, _NO_GROUP, _NO_GROUP),
    }
    fields, arrays = [], []
    for name in _FIELDS:
        q_values, kv_values, q_fill, kv_fill = pairs[name]
        if q_values is not None:
            fields.append(name)
            arrays.extend(_pack_pair(q_values, kv_values, layout, q_fill, kv_fill))
    return tuple(fields), tuple(arrays)


# --------------------------------------------------------------------------------------------
# Kernels.


def _precision(dtype):
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype).itemsize >= 4 else None


def _dot(a, b, contract_a: int, contract_b: int):
    """a @ b contracting the given axes of 2-D blocks, accumulated in f32 (f64 for f64)."""
    acc = jnp.promote_types(a.dtype, jnp.float32)
    return jax.lax.dot_general(
        a,
        b,
        (((contract_a,), (contract_b,)), ((), ())),
        preferred_element_type=acc,
        precision=_precision(a.dtype),
    )


def _block_scores(
    q, k, qi, ki, tokens: dict, layout: Layout, spec: AttentionSpec, keys_minor: bool = False
):
    """Scores of one (q block, kv block) pair and which entries are allowed (``masking``'s rule
    with the block's per-token values ``tokens``: field -> (q [bq, 1], kv [1, bk])); ``k`` is a
    [bk, D] block, or [D, bk] with ``keys_minor`` (see ``SequenceMinor``).

    Returns (s, allowed, capped): ``capped`` is tanh(raw / softcap) when soft-capping, else None.
    """
    s = _dot(q, k, 1, 0 if keys_minor else 1) * spec.scale
    capped = None
    if spec.softcap is not None:
        capped = jnp.tanh(s / spec.softcap)
        s = spec.softcap * capped
    q_index = layout.query_index(qi, s.shape)
    k_index = ki * layout.block_k + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
    real = (q_index < layout.q_len) & (k_index < layout.kv_len)
    if "positions" in tokens or "groups" in tokens:
        if "positions" in tokens:
            q_position, k_position = tokens["positions"]
        else:
            q_position, k_position = q_index + (layout.kv_len - layout.q_len), k_index
        groups = tokens.get("groups", (None, None))
        allowed = real & masking.token_allowed(q_position, k_position, spec, *groups)
    else:
        allowed = real & masking.position_allowed(
            q_index, k_index, layout.q_len, layout.kv_len, spec
        )
    if "segments" in tokens:
        q_ids, kv_ids = tokens["segments"]
        allowed &= q_ids == kv_ids
    return s, allowed, capped


def _ranges_meet(q_values, kv_values):
    """Whether [min, max] of a q block's values and of a kv block's values overlap."""
    return (jnp.max(q_values) >= jnp.min(kv_values)) & (jnp.max(kv_values) >= jnp.min(q_values))


def _groups_meet(q_groups, kv_groups):
    """Whether the ranges of the groups >= 0 of a q block and a kv block overlap."""
    big = jnp.iinfo(jnp.int32).max
    q_min = jnp.min(jnp.where(q_groups >= 0, q_groups, big))
    kv_min = jnp.min(jnp.where(kv_groups >= 0, kv_groups, big))
    return (jnp.max(q_groups) >= kv_min) & (jnp.max(kv_groups) >= q_min)


def _positions_meet(q_positions, kv_positions, spec: AttentionSpec):
    """Whether the rule may allow some pair of a q block's and a kv block's positions."""
    q_min, q_max = jnp.min(q_positions), jnp.max(q_positions)
    k_min, k_max = jnp.min(kv_positions), jnp.max(kv_positions)
    meet = _window_ranges_meet(q_min, q_max, k_min, k_max, spec)
    if spec.causal:
        meet &= k_min <= q_max
    return meet


def _window_ranges_meet(q_min, q_max, k_min, k_max, spec: AttentionSpec):
    """Whether the window alone (``masking.window_allowed``) may allow a pair of positions in
    [q_min, q_max] x [k_min, k_max]: q - k < w, and k - q < w unless the rule is causal (its
    window bounds only the past; the future is the causal rule's, which a group overrides)."""
    window = spec.sliding_window
    if window is None:
        return jnp.asarray(True)
    meet = q_min - k_max < window
    if not spec.causal:
        meet &= k_min - q_max < window
    return meet


def _window_meet(qi, ki, tokens: dict, layout: Layout, spec: AttentionSpec):
    """Whether the window alone may allow a pair of the block pair (conservative): what bounds a
    group's pairs under ``window_bounds_groups``."""
    if "positions" in tokens:
        q_positions, kv_positions = tokens["positions"]
        q_min, q_max = jnp.min(q_positions), jnp.max(q_positions)
        k_min, k_max = jnp.min(kv_positions), jnp.max(kv_positions)
    else:
        offset = layout.kv_len - layout.q_len
        q_first, q_last = layout.query_range(qi)
        q_min, q_max = q_first + offset, q_last + offset
        k_min = ki * layout.block_k
        k_max = jnp.minimum(k_min + layout.block_k - 1, layout.kv_len - 1)
    return _window_ranges_meet(q_min, q_max, k_min, k_max, spec)


def _block_visible(qi, ki, tokens: dict, layout: Layout, spec: AttentionSpec):
    """Whether block pair (qi, ki) may hold an allowed entry: the static index rule, then the
    per-token blocks' ranges (conservative: a visited block is still masked exactly). ``qi`` may
    be a q block or its token block (the index rule reads only its place in the sequence)."""
    visible = layout.visible(qi, ki, masking.block_rule(spec, _token_mask_shape(tokens)))
    if "positions" in tokens:
        rule = _positions_meet(*tokens["positions"], spec)
    else:
        rule = layout.visible(qi, ki, spec)
    if "groups" in tokens:
        together = _groups_meet(*tokens["groups"])
        if spec.window_bounds_groups:
            together &= _window_meet(qi, ki, tokens, layout, spec)
        rule |= together
    if "segments" in tokens:
        visible &= _ranges_meet(*tokens["segments"])
    return visible & rule


def _token_mask_shape(fields) -> TokenMask:
    """A TokenMask standing for which fields are present (values are placeholders)."""
    return TokenMask(
        q_positions=True if "positions" in fields else None,
        q_groups=True if "groups" in fields else None,
    )


def _block_ranges(fields: tuple[str, ...], token_arrays, layout: Layout, spec: AttentionSpec):
    """(kv lo, kv hi, q lo, q hi): for each (batch, token q block) the first and last kv block
    ``_block_visible`` passes, and for each (batch, kv block) the first and last token q block;
    int32 [B * blocks] each, hi = -1 when none. An XLA pre-pass over per-block minima and maxima
    (O(S) reads, B * q blocks * kv blocks scalar tests) whose results the index maps clamp to."""
    nt, nk = layout.num_token_blocks, layout.num_k_blocks
    q_blocks = {
        name: token_arrays[2 * i].reshape(layout.batch, nt, layout.block_q, 1)
        for i, name in enumerate(fields)
    }
    kv_blocks = {
        name: token_arrays[2 * i + 1].reshape(layout.batch, nk, 1, layout.block_k)
        for i, name in enumerate(fields)
    }

    def pair(t, k, q_values, kv_values):
        tokens = {name: (q_values[name], kv_values[name]) for name in fields}
        return _block_visible(t, k, tokens, layout, spec)

    over_k = jax.vmap(pair, in_axes=(None, 0, None, 0))
    over_t = jax.vmap(over_k, in_axes=(0, None, 0, None))
    over_b = jax.vmap(over_t, in_axes=(None, None, 0, 0))
    visible = over_b(jnp.arange(nt), jnp.arange(nk), q_blocks, kv_blocks)  # [B, nt, nk]

    def first_last(v):
        count = v.shape[-1]
        first = jnp.argmax(v, axis=-1)
        last = jnp.where(jnp.any(v, axis=-1), count - 1 - jnp.argmax(v[..., ::-1], axis=-1), -1)
        return first.astype(jnp.int32).reshape(-1), last.astype(jnp.int32).reshape(-1)

    return (*first_last(visible), *first_last(jnp.swapaxes(visible, 1, 2)))


def _in_range(ranges, b, i, count: int, step):
    """Whether ``step`` lies in the [lo, hi] the range refs hold for (batch ``b``, block ``i``
    of ``count``); True when there are no ranges (the static rule's clamp decides)."""
    if not ranges:
        return True
    lo_ref, hi_ref = ranges
    return (lo_ref[b * count + i] <= step) & (step <= hi_ref[b * count + i])


def _split_refs(refs, num_inputs: int, fields: tuple[str, ...]):
    """(range refs, inputs, {field: (q values, kv values)}, outputs and scratch); the two
    scalar-prefetch range refs come first when there are per-token fields."""
    ranges, refs = (refs[:2], refs[2:]) if fields else ((), refs)
    count = num_inputs + 2 * len(fields)
    inputs, rest = refs[:num_inputs], refs[count:]
    token_refs = refs[num_inputs:count]
    tokens = {
        name: (token_refs[2 * i][...], token_refs[2 * i + 1][...]) for i, name in enumerate(fields)
    }
    return ranges, inputs, tokens, rest


def _kept(seed_ref, b, h, qi, ki, shape, layout: Layout, rate: float):
    """``dropout.keep`` for block pair (qi, ki) of batch ``b``, kv head ``h`` (program ids, read
    at the kernel's top: the interpreter has none inside ``pl.when``): the rows' query heads and
    queries from their packed index, the seed and the global offsets from their block."""
    rows = qi * layout.block_q + jax.lax.broadcasted_iota(jnp.int32, (shape[0], 1), 0)
    group = _div(rows, layout.q_len_padded)
    query = rows - group * layout.q_len_padded
    seed, batch_offset, head_offset = (
        seed_ref[:, pl.ds(i * _LANES, _LANES)][:, :1] for i in range(3)
    )
    head = head_offset + h * layout.groups + group
    row_keys = dropout.row_key(seed, batch_offset + b, head, query)
    keys = ki * layout.block_k + jax.lax.broadcasted_iota(jnp.int32, shape, 1)
    return dropout.keep(row_keys, keys, rate)


def _forward_kernel(
    *refs,
    layout: Layout,
    spec: AttentionSpec,
    fields: tuple[str, ...],
    has_sinks: bool,
    dropout_rate: float,
    minor: SequenceMinor,
):
    ranges, (q_ref, k_ref, v_ref), tokens, rest = _split_refs(refs, 3, fields)
    extra = has_sinks + (dropout_rate > 0)
    sink_ref = rest[0] if has_sinks else None
    seed_ref = rest[extra - 1] if dropout_rate > 0 else None
    # lse_ref is empty in the forward-only variant (``attention_out``'s primal).
    o_ref, *lse_ref, m_ref, l_ref, acc_ref = rest[extra:]
    b, h, qi, ki = (pl.program_id(axis) for axis in range(4))
    nt = layout.num_token_blocks
    visible = _in_range(ranges, b, _rem(qi, nt), nt, ki) & _block_visible(
        qi, ki, tokens, layout, spec
    )

    @pl.when(ki == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, _MASK_VALUE, m_ref.dtype)
        l_ref[...] = jnp.zeros(l_ref.shape, l_ref.dtype)
        acc_ref[...] = jnp.zeros(acc_ref.shape, acc_ref.dtype)

    @pl.when(visible)
    def _step():
        s, allowed, _ = _block_scores(
            q_ref[...], k_ref[...], qi, ki, tokens, layout, spec, minor.keys
        )
        m_prev = m_ref[...]
        m_new = jnp.maximum(
            m_prev, jnp.max(jnp.where(allowed, s, _MASK_VALUE), axis=1, keepdims=True)
        )
        alpha = jnp.exp(m_prev - m_new)
        p = jnp.where(allowed, jnp.exp(s - m_new), 0.0)
        l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=1, keepdims=True)
        if seed_ref is not None:  # the denominator keeps every probability, the values do not
            kept = _kept(seed_ref, b, h, qi, ki, s.shape, layout, dropout_rate)
            p = jnp.where(kept, p * dropout.scale(dropout_rate), 0.0)
        v = v_ref[...]
        acc_ref[...] = alpha * acc_ref[...] + _dot(p.astype(v.dtype), v, 1, int(minor.values))
        m_ref[...] = m_new

    @pl.when(ki == pl.num_programs(3) - 1)
    def _finish():
        total, row_max, acc = l_ref[...], m_ref[...], acc_ref[...]
        if sink_ref is not None:  # the sink joins the denominator with a zero value
            sink = sink_ref[...].astype(row_max.dtype)
            with_sink = jnp.maximum(row_max, sink)
            alpha = jnp.exp(row_max - with_sink)
            total = alpha * total + jnp.exp(sink - with_sink)
            acc, row_max = alpha * acc, with_sink
        seen = total > 0
        inverse = jnp.where(seen, 1.0 / jnp.where(seen, total, 1.0), 0.0)
        o_ref[...] = (acc * inverse).astype(o_ref.dtype)
        for ref in lse_ref:
            lse = jnp.where(seen, row_max + jnp.log(jnp.where(seen, total, 1.0)), -jnp.inf)
            ref[...] = _as_lanes(lse)


def _diagonal(n: int):
    return jax.lax.broadcasted_iota(jnp.int32, (n, n), 0) == jax.lax.broadcasted_iota(
        jnp.int32, (n, n), 1
    )


def _chunks(n: int) -> list[tuple[int, int]]:
    """(start, size) of the lane-wide pieces a row/column conversion works in (VMEM ~ n * 128)."""
    return [(start, min(_LANES, n - start)) for start in range(0, n, _LANES)]


def _as_lanes(column):
    """A [n, 1] column as a [1, n] row: per 128-row piece, the diagonal of its broadcast summed
    down the sublanes (exact: one term per lane; -inf stays -inf). Plain selects and reductions,
    which Mosaic lowers for any n, where a transpose of a one-lane column is not."""
    pieces = [
        jnp.sum(jnp.where(_diagonal(w), column[i : i + w], 0.0), axis=0, keepdims=True)
        for i, w in _chunks(column.shape[0])
    ]
    return pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, axis=1)


def _as_column(row):
    """A [1, n] row as a [n, 1] column (``_as_lanes``' inverse, summed across the lanes)."""
    pieces = [
        jnp.sum(jnp.where(_diagonal(w), row[:, i : i + w], 0.0), axis=1, keepdims=True)
        for i, w in _chunks(row.shape[1])
    ]
    return pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, axis=0)


def _probabilities_and_dscores(
    q, k, v, do, lse, delta, qi, ki, tokens, layout, spec, dropped=None, rate: float = 0.0
):
    """p = softmax probabilities (dropped and scaled as the forward applied them when
    ``dropped`` = (seed ref, batch, kv head) is given) and ds = dL/d(raw scaled scores) for one
    block pair."""
    s, allowed, capped = _block_scores(q, k, qi, ki, tokens, layout, spec)
    p = jnp.where(allowed, jnp.exp(s - lse), 0.0)
    dp = _dot(do, v, 1, 1)
    if dropped is not None:  # out = (p * mask / (1 - rate)) v: dp and p through the mask
        kept = _kept(*dropped, qi, ki, s.shape, layout, rate)
        dp = jnp.where(kept, dp * dropout.scale(rate), 0.0)
        ds = p * (dp - delta)
        p = jnp.where(kept, p * dropout.scale(rate), 0.0)
    else:
        ds = p * (dp - delta)
    if capped is not None:
        ds = ds * (1.0 - capped * capped)
    return p, ds


def _dq_kernel(
    *refs, layout: Layout, spec: AttentionSpec, fields: tuple[str, ...], dropout_rate: float
):
    count = 6 + (dropout_rate > 0)
    ranges, inputs, tokens, (dq_ref, dq_acc_ref) = _split_refs(refs, count, fields)
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *seed_ref = inputs
    b, h, qi, ki = (pl.program_id(axis) for axis in range(4))
    dropped = (seed_ref[0], b, h) if seed_ref else None
    nt = layout.num_token_blocks
    visible = _in_range(ranges, b, _rem(qi, nt), nt, ki) & _block_visible(
        qi, ki, tokens, layout, spec
    )

    @pl.when(ki == 0)
    def _init():
        dq_acc_ref[...] = jnp.zeros(dq_acc_ref.shape, dq_acc_ref.dtype)

    @pl.when(visible)
    def _step():
        k = k_ref[...]
        _, ds = _probabilities_and_dscores(
            q_ref[...],
            k,
            v_ref[...],
            do_ref[...],
            _as_column(lse_ref[...]),
            _as_column(delta_ref[...]),
            qi,
            ki,
            tokens,
            layout,
            spec,
            dropped,
            dropout_rate,
        )
        dq_acc_ref[...] += _dot(ds.astype(k.dtype), k, 1, 0)

    @pl.when(ki == pl.num_programs(3) - 1)
    def _finish():
        dq_ref[...] = (dq_acc_ref[...] * spec.scale).astype(dq_ref.dtype)


def _dkv_kernel(
    *refs, layout: Layout, spec: AttentionSpec, fields: tuple[str, ...], dropout_rate: float
):
    count = 6 + (dropout_rate > 0)
    ranges, inputs, tokens, rest = _split_refs(refs, count, fields)
    dk_ref, dv_ref, dk_acc_ref, dv_acc_ref = rest
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *seed_ref = inputs
    b, h, ki, qi = (pl.program_id(axis) for axis in range(4))
    dropped = (seed_ref[0], b, h) if seed_ref else None
    in_range = _in_range(ranges, b, ki, layout.num_k_blocks, _rem(qi, layout.num_token_blocks))
    visible = in_range & _block_visible(qi, ki, tokens, layout, spec)

    @pl.when(qi == 0)
    def _init():
        dk_acc_ref[...] = jnp.zeros(dk_acc_ref.shape, dk_acc_ref.dtype)
        dv_acc_ref[...] = jnp.zeros(dv_acc_ref.shape, dv_acc_ref.dtype)

    @pl.when(visible)
    def _step():
        q, do = q_ref[...], do_ref[...]
        p, ds = _probabilities_and_dscores(
            q,
            k_ref[...],
            v_ref[...],
            do,
            _as_column(lse_ref[...]),
            _as_column(delta_ref[...]),
            qi,
            ki,
            tokens,
            layout,
            spec,
            dropped,
            dropout_rate,
        )
        dv_acc_ref[...] += _dot(p.astype(do.dtype), do, 0, 0)
        dk_acc_ref[...] += _dot(ds.astype(q.dtype), q, 0, 0)

    @pl.when(qi == pl.num_programs(3) - 1)
    def _finish():
        dk_ref[...] = (dk_acc_ref[...] * spec.scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_acc_ref[...].astype(dv_ref.dtype)


# --------------------------------------------------------------------------------------------
# pallas_call wrappers. Grid axes: (batch, kv head, outer block, inner block).


@dataclass(frozen=True)
class _Specs:
    """BlockSpecs of one kernel's operands."""

    rows: pl.BlockSpec  # q and dq [bq, D]
    out_rows: pl.BlockSpec  # out and its cotangent [bq, Dv]
    keys: pl.BlockSpec  # k and dk [bk, D]
    values: pl.BlockSpec  # v and dv [bk, Dv]
    stats: pl.BlockSpec  # per-row statistics (logsumexp, delta), a row [1, bq] per q block
    tokens: list  # per-token (q [bq, 1], kv [1, bk]) pairs, one per field
    sinks: pl.BlockSpec  # packed sinks [Hkv, rows, 1]
    seed: pl.BlockSpec  # the dropout words (``_seed_block``), each in every lane of 128


def _specs(
    layout: Layout,
    spec: AttentionSpec,
    fields: tuple[str, ...],
    *,
    kv_outer: bool,
    minor: SequenceMinor = SequenceMinor(),
):
    """BlockSpecs for q-row inputs, kv inputs, row statistics, per-token arrays and sinks.

    Index maps clamp the inner block to the static rule's range, or with per-token fields to
    the range in the scalar-prefetch refs (``_block_ranges``) they then receive last. K or V
    marked in ``minor`` come as ``[D, bk]`` blocks of ``[B, Hkv, D, Sk]``."""
    d, dv, bq, bk = layout.head_dim, layout.value_dim, layout.block_q, layout.block_k
    spec = masking.block_rule(spec, _token_mask_shape(fields))
    nt, nk = layout.num_token_blocks, layout.num_k_blocks

    def bounds(ranges, b, i, count: int):
        lo_ref, hi_ref = ranges
        return lo_ref[b * count + i], hi_ref[b * count + i]

    if kv_outer:  # grid (b, h, ki, qi): q blocks clamped to those that see kv block ki

        def q_block(b, h, ki, qi, *ranges):
            if not ranges:
                return b, h, layout.clamped_query_block(qi, ki, spec), 0
            start = _div(qi, nt) * nt  # the first q block of qi's head
            return b, h, start + _clamp(_rem(qi, nt), *bounds(ranges, b, ki, nk), nt), 0

        def k_block(b, h, ki, qi, *ranges):
            return b, h, ki, 0
    else:  # grid (b, h, qi, ki): kv blocks clamped to those q block qi sees

        def q_block(b, h, qi, ki, *ranges):
            return b, h, qi, 0

        def k_block(b, h, qi, ki, *ranges):
            if not ranges:
                return b, h, layout.clamped_key_block(qi, ki, spec), 0
            return b, h, _clamp(ki, *bounds(ranges, b, _rem(qi, nt), nt), nk), 0

    def token_block(*idx):  # the q block's queries (one head's rows; see ``_pack_pair``)
        b, _, qi, _ = q_block(*idx)
        return b, _rem(qi, nt), 0

    def kv_spec(dim: int, transposed: bool) -> pl.BlockSpec:
        if not transposed:
            return pl.BlockSpec((None, None, bk, dim), k_block)
        return pl.BlockSpec(
            (None, None, dim, bk), lambda *idx: (*k_block(*idx)[:2], 0, k_block(*idx)[2])
        )

    tokens = [
        pl.BlockSpec((None, bq, 1), token_block),
        pl.BlockSpec((None, 1, bk), lambda *idx: (k_block(*idx)[0], 0, k_block(*idx)[2])),
    ] * len(fields)
    return _Specs(
        rows=pl.BlockSpec((None, None, bq, d), q_block),
        out_rows=pl.BlockSpec((None, None, bq, dv), q_block),
        keys=kv_spec(d, minor.keys),
        values=kv_spec(dv, minor.values),
        stats=pl.BlockSpec((None, None, None, 1, bq), lambda *idx: (*q_block(*idx), 0)),
        tokens=tokens,
        sinks=pl.BlockSpec((None, bq, 1), lambda *idx: (q_block(*idx)[1], q_block(*idx)[2], 0)),
        seed=pl.BlockSpec((1, 3 * _LANES), lambda *idx: (0, 0)),
    )


def _grid_spec(grid, ranges: tuple, in_specs, out_specs, scratch_shapes):
    """The grid with ``ranges`` (``_block_ranges``' arrays, or none) as scalar prefetch."""
    return pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(ranges),
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        scratch_shapes=scratch_shapes,
    )


def _compiler_params(layout: Layout, itemsize: int, vmem_bytes) -> pltpu.CompilerParams:
    """The grid's semantics and the VMEM limit of ``layout``'s blocks (``vmem_bytes`` is the
    kernel's estimate, ``_forward_vmem_bytes`` or ``_backward_vmem_bytes``)."""
    dims = (layout.head_dim, layout.value_dim)
    need = vmem_bytes(layout.block_q, layout.block_k, dims, itemsize)
    return pltpu.CompilerParams(
        dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
        vmem_limit_bytes=_vmem_limit(need),
    )


@dataclass(frozen=True)
class Schedule:
    """What one (batch, kv head) of a kernel's grid computes and fetches under the static rule:
    the ranges of ``Layout.key_block_range`` and ``Layout.clamped_query_block``, counted on the
    host. Per-token masks (segments, positions, groups) skip more blocks at run time."""

    visible: int
    """(q block, kv block) pairs computed."""
    kv_fetches: int
    """kv blocks fetched with the q blocks outer (forward, dq): the pipeline fetches a block
    when its index differs from the previous step's."""
    q_fetches: int
    """q blocks fetched with the kv blocks outer (dk and dv)."""


def _changes(first, last, counts) -> int:
    """Fetches of a sequence of runs: run i fetches ``counts[i]`` distinct blocks from
    ``first[i]`` to ``last[i]``, less one where it starts on the block the run before ended on."""
    return int(np.sum(counts) - np.sum(first[1:] == last[:-1]))


def schedule(layout: Layout, spec: AttentionSpec) -> Schedule:
    """The block schedule of ``layout`` under the static rule ``spec`` (``masking.block_rule``)."""
    bq, bk, nk = layout.block_q, layout.block_k, layout.num_k_blocks
    per_head = layout.num_q_blocks if layout.whole_groups else layout.q_len_padded // bq
    repeats = 1 if layout.whole_groups else layout.groups
    if layout.whole_groups:
        q_first = np.zeros(per_head, np.int64)
        q_last = np.full(per_head, layout.q_len - 1)
    else:
        q_first = np.arange(per_head) * bq
        q_last = np.minimum(q_first + bq - 1, layout.q_len - 1)
    k_first, k_last = (
        np.broadcast_to(bound, q_first.shape)
        for bound in masking.key_range(q_first, q_last, layout.q_len, layout.kv_len, spec, xp=np)
    )
    lo = np.maximum(k_first, 0) // bk
    empty = (k_last < k_first) | (q_last < q_first)
    hi = np.where(empty, -1, np.maximum(k_last, 0) // bk)
    visible = int(np.where(empty, 0, hi - lo + 1).sum()) * repeats
    # q blocks outer: kv block ki clamped into [min(lo, nk - 1), max(hi, lo)] (``_clamp``)
    first = np.minimum(lo, nk - 1)
    last = np.maximum(first, np.minimum(np.maximum(hi, lo), nk - 1))
    kv_fetches = _changes(*(np.tile(x, repeats) for x in (first, last, last - first + 1)))
    # kv blocks outer: q block qi clamped within its head (``clamped_query_block``)
    if layout.whole_groups:  # q block qi itself, every one for every kv block
        blocks = np.tile(np.arange(per_head), nk)
        q_fetches = _changes(blocks, blocks, np.ones_like(blocks))
    else:
        k_first = np.arange(nk) * bk
        k_last = np.minimum(k_first + bk - 1, layout.kv_len - 1)
        q_lo, q_hi = (
            np.clip(np.broadcast_to(bound, k_first.shape), 0, layout.q_len - 1) // bq
            for bound in masking.query_range(
                k_first, k_last, layout.q_len, layout.kv_len, spec, xp=np
            )
        )
        q_end = np.minimum(np.maximum(q_hi, q_lo), per_head - 1)
        # every kv block visits each head's clamped q range in turn (ki outer, head inner)
        offsets = (np.arange(layout.groups) * per_head)[None, :]
        q_fetches = _changes(
            (offsets + q_lo[:, None]).reshape(-1),
            (offsets + q_end[:, None]).reshape(-1),
            np.repeat(q_end - q_lo + 1, layout.groups),
        )
    return Schedule(visible, kv_fetches, q_fetches)


def _stat_dims(dtype) -> int:
    """A per-row statistic (logsumexp, delta: f32, or f64 with f64 inputs) in ``dtype`` items."""
    return jnp.dtype(jnp.promote_types(dtype, jnp.float32)).itemsize // jnp.dtype(dtype).itemsize


def _cost(
    layout: Layout, spec: AttentionSpec, itemsize: int, matmul_dims: int, *, q_dims, kv_dims,
    kv_outer: bool,
):  # fmt: skip
    """The block schedule's count (``schedule``): each computed pair multiplies a whole
    ``block_q x block_k`` tile (``matmul_dims``: the summed contraction/output dims of the
    kernel's matmuls per score); the outer axis's blocks (``q_dims`` or ``kv_dims``: feature
    dims of each array over the packed rows or the keys, inputs and outputs) move once, the
    inner axis's once per fetch. Per-token mask arrays, sinks and the dropout seed (O(S) or
    less) are not counted."""
    plan = schedule(layout, spec)
    heads = layout.batch * layout.kv_heads
    rows, keys = heads * layout.rows, heads * layout.kv_len_padded
    if kv_outer:
        rows = heads * plan.q_fetches * layout.block_q
    else:
        keys = heads * plan.kv_fetches * layout.block_k
    scores = heads * plan.visible * layout.block_q * layout.block_k
    return pl.CostEstimate(
        flops=2 * matmul_dims * scores,
        transcendentals=scores,
        bytes_accessed=(rows * sum(q_dims) + keys * sum(kv_dims)) * itemsize,
    )


def _forward(
    q,
    k,
    v,
    tokens,
    sinks,
    seed,
    layout: Layout,
    spec: AttentionSpec,
    interpret: bool,
    with_lse: bool,
    dropout_rate: float,
    minor: SequenceMinor,
):
    """Packed-layout forward: [out [B, Hkv, rows, Dv], lse [B, Hkv, q blocks, 1, bq]], or [out]
    without ``with_lse``; ``tokens`` is (fields, packed arrays) from ``_pack_tokens``; ``seed``
    the dropout block (``_seed_block``; None without dropout); K or V transposed as ``minor``
    marks them."""
    (fields, token_arrays), has_sinks = tokens, sinks is not None
    specs = _specs(layout, spec, fields, kv_outer=False, minor=minor)
    ranges = _block_ranges(fields, token_arrays, layout, spec)[:2] if fields else ()
    shape = (layout.batch, layout.kv_heads, layout.num_q_blocks, layout.num_k_blocks)
    acc = jnp.promote_types(q.dtype, jnp.float32)
    rule = masking.block_rule(spec, _token_mask_shape(fields))
    kernel = functools.partial(
        _forward_kernel,
        layout=layout,
        spec=spec,
        fields=fields,
        has_sinks=has_sinks,
        dropout_rate=dropout_rate,
        minor=minor,
    )
    return pl.pallas_call(
        kernel,
        grid_spec=_grid_spec(
            shape,
            ranges,
            in_specs=[
                specs.rows,
                specs.keys,
                specs.values,
                *specs.tokens,
                *([specs.sinks] if has_sinks else []),
                *([specs.seed] if seed is not None else []),
            ],
            out_specs=[specs.out_rows, *[specs.stats] * with_lse],
            scratch_shapes=[
                pltpu.VMEM((layout.block_q, 1), acc),
                pltpu.VMEM((layout.block_q, 1), acc),
                pltpu.VMEM((layout.block_q, layout.value_dim), acc),
            ],
        ),
        out_shape=[
            jax.ShapeDtypeStruct((*q.shape[:3], layout.value_dim), q.dtype),
            *[jax.ShapeDtypeStruct((*q.shape[:2], layout.num_q_blocks, 1, layout.block_q), acc)]
            * with_lse,
        ],
        compiler_params=_compiler_params(layout, q.dtype.itemsize, _forward_vmem_bytes),
        cost_estimate=_cost(
            layout,
            rule,
            q.dtype.itemsize,
            layout.head_dim + layout.value_dim,
            q_dims=(layout.head_dim, layout.value_dim, *[_stat_dims(q.dtype)] * with_lse),
            kv_dims=(layout.head_dim, layout.value_dim),
            kv_outer=False,
        ),
        interpret=interpret,
        name="flash_attention_forward",
    )(*ranges, q, k, v, *token_arrays, *(x for x in (sinks, seed) if x is not None))


def _backward(
    q,
    k,
    v,
    tokens,
    do,
    lse,
    delta,
    seed,
    layout: Layout,
    spec: AttentionSpec,
    interpret,
    dropout_rate: float,
):
    """Packed-layout backward: (dq, dk, dv); ``seed`` as in ``_forward``."""
    fields, token_arrays = tokens
    acc = jnp.promote_types(q.dtype, jnp.float32)
    rule = masking.block_rule(spec, _token_mask_shape(fields))
    kernel_args = dict(layout=layout, spec=spec, fields=fields, dropout_rate=dropout_rate)
    seeds = () if seed is None else (seed,)
    operands = (q, k, v, do, lse, delta, *seeds, *token_arrays)
    ranges = _block_ranges(fields, token_arrays, layout, spec) if fields else ()

    d, dv = layout.head_dim, layout.value_dim

    def in_specs(specs: _Specs) -> list:
        return [
            specs.rows,
            specs.keys,
            specs.values,
            specs.out_rows,
            specs.stats,
            specs.stats,
            *[specs.seed] * len(seeds),
            *specs.tokens,
        ]

    specs = _specs(layout, spec, fields, kv_outer=False)
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, **kernel_args),
        grid_spec=_grid_spec(
            (layout.batch, layout.kv_heads, layout.num_q_blocks, layout.num_k_blocks),
            ranges[:2],
            in_specs=in_specs(specs),
            out_specs=specs.rows,
            scratch_shapes=[pltpu.VMEM((layout.block_q, d), acc)],
        ),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=_compiler_params(layout, q.dtype.itemsize, _backward_vmem_bytes),
        cost_estimate=_cost(
            layout,
            rule,
            q.dtype.itemsize,
            2 * d + dv,
            q_dims=(d, dv, d, _stat_dims(q.dtype), _stat_dims(q.dtype)),  # q, do, dq, lse, delta
            kv_dims=(d, dv),
            kv_outer=False,
        ),
        interpret=interpret,
        name="flash_attention_backward_dq",
    )(*ranges[:2], *operands)

    specs = _specs(layout, spec, fields, kv_outer=True)
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, **kernel_args),
        grid_spec=_grid_spec(
            (layout.batch, layout.kv_heads, layout.num_k_blocks, layout.num_q_blocks),
            ranges[2:],
            in_specs=in_specs(specs),
            out_specs=[specs.keys, specs.values],
            scratch_shapes=[
                pltpu.VMEM((layout.block_k, d), acc),
                pltpu.VMEM((layout.block_k, dv), acc),
            ],
        ),
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=_compiler_params(layout, q.dtype.itemsize, _backward_vmem_bytes),
        cost_estimate=_cost(
            layout,
            rule,
            q.dtype.itemsize,
            2 * d + 2 * dv,
            q_dims=(d, dv, _stat_dims(q.dtype), _stat_dims(q.dtype)),  # q, do, lse, delta
            kv_dims=(d, dv, d, dv),  # k, v, dk, dv
            kv_outer=True,
        ),
        interpret=interpret,
        name="flash_attention_backward_dkv",
    )(*ranges[2:], *operands)
    return dq, dk, dv


# --------------------------------------------------------------------------------------------
# Public functions in the [B, H, S, D] layout.


def _layout(q, k, v, blocks: BlockSizes) -> Layout:
    return make_layout(q.shape, k.shape, blocks, value_dim=v.shape[-1])


def _seed_block(seed, dropout_rate: float):
    """The dropout ``seed`` (``dropout.as_words``: seed, batch and head offsets) as a [1, 384]
    block, each word in every lane of its 128 (read at aligned lanes); None without dropout."""
    if not dropout_rate:
        return None
    return jnp.repeat(dropout.as_words(seed), _LANES)[None]


def attention_forward(
    q,
    k,
    v,
    tokens,
    sinks,
    spec,
    blocks: KernelBlocks,
    interpret,
    with_lse=True,
    seed=None,
    dropout_rate: float = 0.0,
):
    """(out [B, Hq, Sq, Dv], logsumexp [B, Hq, Sq] f32), or out alone without ``with_lse`` (the
    kernel then writes no statistics); no autodiff rule (see ``attention``). ``dropout_rate`` >
    0 drops probabilities as ``dropout.keep`` marks them for ``seed`` (int32 [] or
    ``dropout.words``)."""
    layout = _layout(q, k, v, blocks.forward)
    minor = sequence_minor(layout)
    k, v = (
        jnp.swapaxes(x, 2, 3) if transposed else x
        for x, transposed in (
            (_pad_keys(k, layout), minor.keys),
            (_pad_keys(v, layout), minor.values),
        )
    )
    out, *lse = _forward(
        _pack_rows(q, layout),
        k,
        v,
        _pack_tokens(tokens, layout),
        None
        if sinks is None
        else _pack_sinks(sinks, layout, jnp.promote_types(q.dtype, jnp.float32)),
        _seed_block(seed, dropout_rate),
        layout,
        spec,
        interpret,
        with_lse,
        dropout_rate,
        minor,
    )
    if not with_lse:
        return _unpack_rows(out, layout)
    lse = lse[0].reshape(layout.batch, layout.kv_heads, layout.rows)
    return _unpack_rows(out, layout), _unpack_rows(lse, layout)


def _pack_row_stats(x, layout: Layout):
    """[B, Hq, Sq] per-row statistics -> the kernels' lane-dense [B, Hkv, q blocks, 1, bq]."""
    packed = _pack_rows(x, layout)
    return packed.reshape(layout.batch, layout.kv_heads, layout.num_q_blocks, 1, layout.block_q)


def attention_backward(
    q,
    k,
    v,
    tokens: TokenMask | None,
    sinks,
    out,
    lse,
    d_out,
    d_lse,
    spec: AttentionSpec,
    blocks: KernelBlocks,
    interpret: bool,
    seed=None,
    dropout_rate: float = 0.0,
):
    """(dq, dk, dv, d_sinks) from the forward's outputs and the cotangents of out and logsumexp;
    d_sinks is None without sinks. With dropout, the forward's ``seed`` and ``dropout_rate``:
    the mask is computed again, and delta = rowsum(out * d_out) still holds (out is the dropped
    probabilities times v)."""
    layout = _layout(q, k, v, blocks.backward)
    acc = jnp.promote_types(q.dtype, jnp.float32)
    delta = jnp.sum(out.astype(acc) * d_out.astype(acc), axis=-1)
    if d_lse is not None:
        delta = delta - d_lse.astype(acc)
    dq, dk, dv = _backward(
        _pack_rows(q, layout),
        _pad_keys(k, layout),
        _pad_keys(v, layout),
        _pack_tokens(tokens, layout),
        _pack_rows(d_out.astype(q.dtype), layout),
        _pack_row_stats(lse.astype(acc), layout),
        _pack_row_stats(delta, layout),
        _seed_block(seed, dropout_rate),
        layout,
        spec,
        interpret,
        dropout_rate,
    )
    kv_len = layout.kv_len
    d_sinks = None
    if sinks is not None:
        # The sink is one more score with a zero value: its probability times (0 - delta).
        sink_probability = jnp.exp(sinks.astype(acc)[None, :, None] - lse.astype(acc))
        d_sinks = -jnp.sum(sink_probability * delta, axis=(0, 2)).astype(sinks.dtype)
    return _unpack_rows(dq, layout), dk[:, :, :kv_len], dv[:, :, :kv_len], d_sinks


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 9))
def attention(
    q, k, v, tokens, sinks, spec, blocks: KernelBlocks, interpret, seed=None, dropout_rate=0.0
):
    """Differentiable (out, logsumexp); q [B, Hq, Sq, D], k [B, Hkv, Sk, D], v [B, Hkv, Sk, Dv],
    tokens ``masking.TokenMask`` | None, sinks [Hq] | None; dropout as ``attention_forward``."""
    return attention_forward(
        q, k, v, tokens, sinks, spec, blocks, interpret, True, seed, dropout_rate
    )


def _attention_fwd(q, k, v, tokens, sinks, spec, blocks, interpret, seed, dropout_rate):
    out, lse = attention_forward(
        q, k, v, tokens, sinks, spec, blocks, interpret, True, seed, dropout_rate
    )
    return (out, lse), (q, k, v, tokens, sinks, out, lse, seed)


def _attention_bwd(spec, blocks, interpret, dropout_rate, residuals, cotangents):
    q, k, v, tokens, sinks, out, lse, seed = residuals
    dq, dk, dv, d_sinks = attention_backward(
        q, k, v, tokens, sinks, out, lse, *cotangents, spec, blocks, interpret, seed, dropout_rate
    )
    return dq, dk, dv, None, d_sinks, None


attention.defvjp(_attention_fwd, _attention_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 9))
def attention_out(
    q, k, v, tokens, sinks, spec, blocks: KernelBlocks, interpret, seed=None, dropout_rate=0.0
):
    """``attention``'s out alone: a program that takes no gradient writes no logsumexp."""
    return attention_forward(
        q, k, v, tokens, sinks, spec, blocks, interpret, False, seed, dropout_rate
    )


def _attention_out_fwd(q, k, v, tokens, sinks, spec, blocks, interpret, seed, dropout_rate):
    (out, _), residuals = _attention_fwd(
        q, k, v, tokens, sinks, spec, blocks, interpret, seed, dropout_rate
    )
    return out, residuals


def _attention_out_bwd(spec, blocks, interpret, dropout_rate, residuals, d_out):
    return _attention_bwd(spec, blocks, interpret, dropout_rate, residuals, (d_out, None))


attention_out.defvjp(_attention_out_fwd, _attention_out_bwd)


__all__ = [
    "BlockSizes",
    "KernelBlocks",
    "attention",
    "attention_backward",
    "attention_forward",
    "attention_out",
    "blocks_problem",
    "default_blocks",
]
