"""The torch entry points (forward only) that bucket shapes and check values around the raw ops.

A serving step changes the number of tokens, sequences, keys and pages every time; a JAX
function compiles once per input shape. ``ragged_attention`` and ``paged_attention`` therefore
pad each of those counts up to a power of two with what the ops define as padding (queries and
keys past the last offset, zero-length sequences, -1 table entries), so a serving run compiles
at most a few times per bucket. Offsets and block tables are data: on CPU tensors they are
checked before any kernel runs (cheap there); on an accelerator they are not read back, which
would stall every layer.

The raw ops are declared with their JAX functions (``api``); the entry points' keywords are
``RaggedSpec``'s fields (``takes_options``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernel_hub.kernel_api import host_values, option_values, takes_options

from . import api
from .options import PAGED_UNUSED, RAGGED_UNUSED, RaggedSpec

ragged_attention_op = api.ragged_attention.torch
paged_attention_op = api.paged_attention.torch


# Smallest buckets: below them padding costs less than another compilation (a TPU computes in
# tiles of 8-16 rows and 128 lanes anyway).
MIN_TOKENS, MIN_KEYS, MIN_SEQUENCES, MIN_PAGES = 16, 128, 8, 8


def _bucket(count: int, smallest: int) -> int:
    """The smallest power of two >= ``count`` and >= ``smallest``: log2 buckets."""
    return max(smallest, 1 << (count - 1).bit_length() if count > 0 else 0)


def _pad_offsets(cu: torch.Tensor, sequences: int) -> torch.Tensor:
    """Offsets for ``sequences`` sequences: the extra ones have length zero."""
    extra = sequences + 1 - cu.shape[0]
    return torch.cat([cu, cu[-1:].expand(extra)]) if extra else cu


def _pad_keys(x: torch.Tensor, extra: int) -> torch.Tensor:
    """[N, Hkv, D] with ``extra`` zero keys appended (8-bit K/V padded as bytes: torch's CPU pad
    takes no float8; a zero byte is zero in both 8-bit formats)."""
    if x.element_size() == 1 and x.dtype != torch.uint8:
        return F.pad(x.view(torch.uint8), (0, 0, 0, 0, 0, extra)).view(x.dtype)
    return F.pad(x, (0, 0, 0, 0, 0, extra))


@takes_options(RaggedSpec, exclude=RAGGED_UNUSED)
def ragged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_lens_q: torch.Tensor,
    cu_seq_lens_k: torch.Tensor,
    sinks: torch.Tensor | None = None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    *,
    options: RaggedSpec,
) -> torch.Tensor:
    """q [T, Hq, D], k/v [N, Hkv, D] (8-bit with scales [Hkv, N]: see
    ``api.ragged_attention``), offsets [S+1] -> [T, Hq, D], with T, N and S bucketed."""
    api.check_ragged_inputs(
        query, key, value, cu_seq_lens_q, cu_seq_lens_k, sinks, k_scales, v_scales
    )
    tokens, keys = query.shape[0], key.shape[0]
    cu_q, cu_k = cu_seq_lens_q.to(torch.int32), cu_seq_lens_k.to(torch.int32)
    cu_q_values, cu_k_values = host_values(cu_q), host_values(cu_k)
    if cu_q_values is not None and cu_k_values is not None:  # before the offsets are padded
        api.check_ragged_values(cu_q_values, cu_k_values, tokens, keys, options.causal)
    sequences = _bucket(cu_q.shape[0] - 1, MIN_SEQUENCES)
    padded_tokens, padded_keys = _bucket(tokens, MIN_TOKENS), _bucket(keys, MIN_KEYS)
    k_scales, v_scales = (
        None if s is None else F.pad(s, (0, padded_keys - keys), value=1.0)
        for s in (k_scales, v_scales)
    )
    out = ragged_attention_op(
        F.pad(query, (0, 0, 0, 0, 0, padded_tokens - tokens)),
        _pad_keys(key, padded_keys - keys),
        _pad_keys(value, padded_keys - keys),
        _pad_offsets(cu_q, sequences),
        _pad_offsets(cu_k, sequences),
        sinks,
        k_scales=k_scales,
        v_scales=v_scales,
        **option_values(options, RAGGED_UNUSED),
    )
    return out[:tokens]


def check_paged_values(block_table: torch.Tensor, kv_lens: torch.Tensor, k_pages: torch.Tensor):
    """The block table's values against the cache (eager CPU tensors; see the module doc)."""
    table, lens = host_values(block_table), host_values(kv_lens)
    if table is not None and lens is not None:
        api.check_paged_values(table, lens, k_pages.shape[0], k_pages.shape[1])


@takes_options(RaggedSpec, exclude=PAGED_UNUSED)
def paged_attention(
    query: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    kv_lens: torch.Tensor,
    sinks: torch.Tensor | None = None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    *,
    options: RaggedSpec,
) -> torch.Tensor:
    """q [S, Hq, D], pages [P, page, Hkv, D] (8-bit with scales [P, Hkv, page]: see
    ``api.paged_attention``), block_table [S, max_pages], kv_lens [S] -> [S, Hq, D], with S and
    max_pages bucketed."""
    api.check_paged_inputs(query, k_pages, v_pages, block_table, kv_lens, sinks, k_scales, v_scales)
    table, lens = block_table.to(torch.int32), kv_lens.to(torch.int32)
    check_paged_values(table, lens, k_pages)
    seqs, max_pages = table.shape
    extra_seqs = _bucket(seqs, MIN_SEQUENCES) - seqs
    table = F.pad(table, (0, _bucket(max_pages, MIN_PAGES) - max_pages, 0, extra_seqs), value=-1)
    out = paged_attention_op(
        F.pad(query, (0, 0, 0, 0, 0, extra_seqs)),
        k_pages,
        v_pages,
        table,
        F.pad(lens, (0, extra_seqs)),
        sinks,
        k_scales=k_scales,
        v_scales=v_scales,
        **option_values(options, PAGED_UNUSED),
    )
    return out[:seqs]
