"""Transformers continuous batching: an ``AttentionInterface`` function for ``generate_batch``.

Continuous batching (``model.generate_batch``, ``init_continuous_batching``) accepts only
``sdpa``, ``paged|eager`` or a name containing "flash", and calls a flash-named function with
``attention_mask=None`` and the batch described by keyword arguments. Two call shapes arrive:

* index path (every prefill, mixed and decode batch by default): q [1, Hq, T, D] with all
  requests packed, ``cu_seq_lens_q/k`` [S+1]; this runs ``ragged_attention``.
* block-table path (decode batches, when ``max_blocks_per_request > 0``): one new token per
  request and this layer group's ``block_table`` [S, max_blocks]; this runs ``paged_attention``.

On Transformers' own cache (models with sliding-window layers) only the index path arrives, and
k/v [1, Hkv, N, D] are each request's whole history, already written and read back by the cache.
On kernel-hub's serving cache (``kernel_hub.layers.integrations.serving_cache``) the cache writes
nothing: it hands over the whole buffer as pages, ``kv_pages`` [P, page, Hkv, D], the layer's page
offsets ``kv_page_offsets`` (keys, values) and, 8-bit, the scale pages ``kv_scale_pages`` [P,
Hkv, page]; this function writes the new K/V into the buffer by index (token ``t`` of the layer's
keys is row ``t % page`` of page ``t // page`` + the keys' offset), quantizing them when the cache
is 8-bit (``kv_quant.quantize``), and reads them back the same way: the index path gathers each
request's history (``kv_read_index``) for ``ragged_attention``; the block-table path gathers the
pages the block table names (keys and values live in pages of one buffer at offsets 2i and
2i + 1; ``paged_attention`` takes one page id for both, so their pages are gathered, never the
whole buffer) and runs ``paged_attention`` on them. Nothing is written through a view of the
buffer: under torchax ``Tensor.view`` returns a copy, and a write through it would be lost.

A third caller is kernel-hub's static serving cache (``generate`` with
``cache_implementation="static"`` inside ``kernel_hub.layers.integrations.static_kv_cache``'s
``static_kv_cache``): its update hands over ``static_kv_cache`` (the cache layer: ``k_pages`` and
``v_pages`` [B * n, page, Hkv, D], sequence ``b`` owning pages ``b * n`` to ``b * n + n - 1``;
``k_scale_pages`` and ``v_scale_pages`` [B * n, Hkv, page] f32 when 8-bit, else None;
``pages_per_sequence`` n; ``length``, the keys per sequence, the new ones included, a host
int) and the new tokens ``static_kv_new`` (key, value [B, Hkv, S, D]); q is [B, Hq, S, D]. The
new tokens are written (quantized) by index as above; a decode step (S = 1) runs
``paged_attention`` on the cache's own key and value pages in place, no slice or view of them
(the block table is fixed: ``arange(B * n)`` by rows); a longer step reads each sequence's keys
back by index and runs ``ragged_attention``. Every sequence of a static batch has the same
length, so padding (an attention mask with a zero) is refused.

Outside those calls (no ``cu_seq_lens_q``, no ``static_kv_cache``) the function refuses:
kernel-hub switches a model to it only for the life of a batching manager or of a
``static_kv_cache`` block (see kernel-hub's Transformers integration). Arguments it does not
implement are refused by name, never ignored.
"""

from __future__ import annotations

import torch

from kernel_hub.kernel_api import KernelInputError

from . import kv_quant
from .torch_api import check_paged_values, paged_attention, ragged_attention

DEFAULT_NAME = "kernel_hub_flash_serving"
"""Contains "flash": the only custom names continuous batching accepts."""
# What kernelize() checks before using it in a mode: forward only, eager only.
can_torch_compile = False
has_backward = False
module_problem = None  # every module the interface dispatches is served

HONOURED = (
    "cu_seq_lens_q",
    "cu_seq_lens_k",
    "is_causal",
    "block_table",
    "kv_pages",
    "kv_page_offsets",
    "kv_scale_pages",
    "kv_write_index",
    "kv_read_index",
    "static_kv_cache",
    "static_kv_new",
    "s_aux",
)
"""Keyword arguments this function reads."""
KNOWN_HARMLESS = (
    "position_ids",
    "use_cache",
    "max_length_q",
    "max_length_k",
    "logits_indices",
    "logits_processor_args",
    "read_index",
    "write_index",
    "output_attentions",
    "output_router_logits",
)
"""Keyword arguments that carry nothing attention needs (positions are already in q/k, the
cache indices were used by the cache update, router logits are the MoE layer's business)."""


def _refuse_unknown(kwargs: dict) -> None:
    unknown = sorted(
        k
        for k, v in kwargs.items()
        if k not in HONOURED and k not in KNOWN_HARMLESS and v is not None
    )
    if unknown:
        raise KernelInputError(
            f"continuous_batching_attention: arguments {unknown} are not implemented by "
            f"kernel-hub's serving attention (it honours {', '.join(HONOURED)}); "
            "use attn_implementation='sdpa' for this model"
        )
    if kwargs.get("output_attentions"):
        raise KernelInputError(
            "continuous_batching_attention: output_attentions=True is not supported"
        )


def _kernel_window(sliding_window: int | None, causal: bool) -> int | None:
    """Transformers' window to the kernel's: causal keeps q - k < w (the same); bidirectional
    keeps |q - k| <= w, which is the kernel's |q - k| < w + 1."""
    if sliding_window is None:
        return None
    return sliding_window if causal else sliding_window + 1


def _rows(pages: torch.Tensor, offset: int, tokens: torch.Tensor):
    """(page, row) in ``pages`` of token ``tokens`` of the layer view starting at page
    ``offset``."""
    page = pages.shape[1]
    return tokens // page + offset, tokens % page


def write_tokens(
    kv_pages: torch.Tensor,
    offsets: tuple[int, int],
    key: torch.Tensor,
    value: torch.Tensor,
    tokens: torch.Tensor,
    scale_pages: torch.Tensor | None = None,
) -> None:
    """Write key/value [T, Hkv, D] at token ``tokens`` [T] of the layer's keys/values, whose
    pages start at ``offsets`` in ``kv_pages`` [P, page, Hkv, D], in place by index. With
    ``scale_pages`` [P, Hkv, page] the cache is 8-bit: quantize on write (``kv_quant``), the
    scale of a token at ``[its page, :, its row]``."""
    for offset, states in zip(offsets, (key, value), strict=True):
        write_states(kv_pages, offset, states, tokens, scale_pages)


def write_states(
    kv_pages: torch.Tensor,
    offset: int,
    states: torch.Tensor,
    tokens: torch.Tensor,
    scale_pages: torch.Tensor | None = None,
) -> None:
    """``write_tokens`` for one of key or value: states [T, Hkv, D] at token ``tokens`` of the
    view whose pages start at ``offset``."""
    pages, rows = _rows(kv_pages, offset, tokens)
    if scale_pages is None:
        kv_pages.index_put_((pages, rows), states.to(kv_pages.dtype))
        return
    # indexed in their own dtype: a dtype-reinterpreting view (to bytes) is a copy under torchax,
    # or no view at all, and the write would not reach the cache
    values, scale = kv_quant.quantize(states, kv_pages.dtype)
    kv_pages.index_put_((pages, rows), values)
    scale_pages[pages, :, rows] = scale


def read_tokens(
    kv_pages: torch.Tensor,
    offset: int,
    tokens: torch.Tensor,
    scale_pages: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Tokens ``tokens`` of the layer view starting at page ``offset``: values [len(tokens),
    Hkv, D] and, 8-bit, their scales [Hkv, len(tokens)] (``ragged_attention``'s layout)."""
    pages, rows = _rows(kv_pages, offset, tokens)
    values = kv_pages[pages, rows]
    if scale_pages is None:
        return values, None
    return values, scale_pages[pages, :, rows].T.contiguous()


def gather_pages(
    kv_pages: torch.Tensor,
    offsets: tuple[int, int],
    block_table: torch.Tensor,
    scale_pages: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor | None], torch.Tensor]:
    """The pages ``block_table`` [S, M] names, of the layer's keys and of its values: K and V
    pages [S * M, page, Hkv, D], their scales (8-bit) and the table over them (entry ``s * M +
    j``, -1 where ``block_table`` has -1)."""
    table = block_table.to(torch.int64)
    ids = table.clamp(min=0).reshape(-1)
    scales: dict[str, torch.Tensor | None] = {"k_scales": None, "v_scales": None}
    gathered = []
    for offset, name in zip(offsets, ("k_scales", "v_scales"), strict=True):
        gathered.append(kv_pages[ids + offset])
        if scale_pages is not None:
            scales[name] = scale_pages[ids + offset]
    positions = torch.arange(ids.shape[0], device=table.device).view(table.shape)
    compact = torch.where(table >= 0, positions, -1).to(block_table.dtype)
    return gathered[0], gathered[1], scales, compact


def decode_slots(block_table: torch.Tensor, kv_lens: torch.Tensor, page: int) -> torch.Tensor:
    """Token of each sequence's newest token in the layer's view: position ``kv_lens[s] - 1``
    lives at ``block_table[s, pos // page] * page + pos % page``."""
    position = kv_lens.to(torch.int64) - 1
    pages = block_table.to(torch.int64).gather(1, (position // page)[:, None])[:, 0]
    return pages * page + position % page


def _decode_lengths(cu_q: torch.Tensor, cu_k: torch.Tensor, tokens: int) -> torch.Tensor:
    """kv_lens of a block-table decode batch, which must hold one new token per sequence."""
    if cu_q.shape[0] - 1 != tokens:
        raise KernelInputError(
            f"continuous_batching_attention: a block-table batch needs one token per sequence; "
            f"got {tokens} tokens for {cu_q.shape[0] - 1} sequences"
        )
    if cu_q.device.type == "cpu" and not bool((cu_q.diff() == 1).all()):
        raise KernelInputError(
            "continuous_batching_attention: a block-table batch needs one token per sequence; "
            f"cu_seq_lens_q is {cu_q.tolist()}"
        )
    return cu_k.diff()


def continuous_batching_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """AttentionInterface contract for continuous batching: q [1, Hq, T, D], k/v [1, Hkv, N, D]
    -> (out [1, T, Hq, D], None)."""
    _refuse_unknown(kwargs)
    if dropout > 0.0:
        raise KernelInputError(
            f"continuous_batching_attention: dropout={dropout} is not supported (serving)"
        )
    is_causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    options = dict(sliding_window=_kernel_window(sliding_window, causal), softcap=softcap)
    options["scale"] = scaling
    cache = kwargs.get("static_kv_cache")
    if cache is not None:
        new = kwargs.get("static_kv_new")
        sinks = kwargs.get("s_aux")
        return static_cache_attention(query, attention_mask, cache, new, causal, sinks, **options)
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is None or cu_k is None:
        raise KernelInputError(
            "continuous_batching_attention serves continuous batching calls (with cu_seq_lens_q "
            "and cu_seq_lens_k) and kernel-hub's static serving cache (static_kv_cache: generate "
            "with cache_implementation='static' inside static_kv_cache(model, ...)); this call "
            "has neither. Outside those the model runs its own attention implementation."
        )
    if attention_mask is not None:
        raise KernelInputError(
            "continuous_batching_attention: got an attention mask; continuous batching with a "
            "flash-named implementation passes none (the batch is described by cu_seq_lens)"
        )
    if query.shape[0] != 1:
        raise KernelInputError(
            f"continuous_batching_attention: query {tuple(query.shape)} must pack every request "
            "into one row (batch 1), as continuous batching does"
        )
    sinks = kwargs.get("s_aux")
    q = query[0].transpose(0, 1)  # [T, Hq, D]
    block_table = kwargs.get("block_table")
    key, value = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T or N, Hkv, D]
    kv_pages, offsets = kwargs.get("kv_pages"), kwargs.get("kv_page_offsets")
    scale_pages = kwargs.get("kv_scale_pages")
    if kv_pages is None and (block_table is not None or scale_pages is not None):
        raise KernelInputError(
            "continuous_batching_attention: a block_table or cache scales came without "
            "kv_pages; the block-table path and the 8-bit cache need kernel-hub's serving cache "
            "(kernel_hub.layers.integrations.serving_cache, installed by kernelize's "
            "init_continuous_batching)"
        )
    if kv_pages is not None and (offsets is None or len(offsets) != 2):
        raise KernelInputError(
            f"continuous_batching_attention: kv_pages needs kv_page_offsets (the layer's key "
            f"and value page offsets), got {offsets!r}"
        )
    if block_table is not None:
        kv_lens = _decode_lengths(cu_q, cu_k, q.shape[0])
        slots = decode_slots(block_table, kv_lens, kv_pages.shape[1])
        write_tokens(kv_pages, offsets, key, value, slots, scale_pages)
        k_pages, v_pages, scales, table = gather_pages(kv_pages, offsets, block_table, scale_pages)
        check_paged_values(table, kv_lens, k_pages)
        out = paged_attention(q, k_pages, v_pages, table, kv_lens, sinks, **scales, **options)
        return out.unsqueeze(0), None
    scales = {"k_scales": None, "v_scales": None}
    if kv_pages is not None:  # kernel-hub's serving cache: write, read back
        key, value, scales = _history(kv_pages, offsets, key, value, scale_pages, kwargs)
    out = ragged_attention(q, key, value, cu_q, cu_k, sinks, **scales, causal=causal, **options)
    return out.unsqueeze(0), None


def static_cache_attention(
    query: torch.Tensor,
    attention_mask: torch.Tensor | None,
    cache,
    new: tuple[torch.Tensor, torch.Tensor] | None,
    causal: bool,
    sinks: torch.Tensor | None = None,
    **options,
) -> tuple[torch.Tensor, None]:
    """A step on kernel-hub's static serving cache (see the module doc): q [B, Hq, S, D], the
    new key/value [B, Hkv, S, D] in ``new`` -> (out [B, S, Hq, D], None)."""
    op = "continuous_batching_attention (static cache)"
    if new is None:
        raise KernelInputError(f"{op}: static_kv_cache came without static_kv_new (the new K/V)")
    if not causal:
        raise KernelInputError(f"{op}: the static serving cache runs causal decoders only")
    batch, heads, tokens, dim = query.shape
    k_pages, v_pages = cache.k_pages, cache.v_pages
    k_scale_pages, v_scale_pages = cache.k_scale_pages, cache.v_scale_pages
    sequences, page = k_pages.shape[0], k_pages.shape[1]
    if new[0].shape[0] != batch or sequences != batch * cache.pages_per_sequence:
        raise KernelInputError(
            f"{op}: query batch {batch}, new keys {tuple(new[0].shape)} and cache pages "
            f"{tuple(k_pages.shape)} ({cache.pages_per_sequence} per sequence) disagree"
        )
    length = cache.length  # keys per sequence, new ones included
    _check_static_mask(op, attention_mask, batch, length)
    device = k_pages.device
    first = torch.arange(batch, device=device) * (cache.pages_per_sequence * page)
    slots = (first[:, None] + torch.arange(length - tokens, length, device=device)).reshape(-1)
    for pages, scale_pages, states in zip(
        (k_pages, v_pages), (k_scale_pages, v_scale_pages), new, strict=True
    ):
        packed = states.transpose(1, 2).reshape(batch * tokens, states.shape[1], -1)
        write_states(pages, 0, packed, slots, scale_pages)
    q = query.transpose(1, 2).reshape(batch * tokens, heads, dim)
    if tokens == 1:  # decode: the pages in place, sequence b's in table row b
        table = torch.arange(sequences, dtype=torch.int32, device=device).view(batch, -1)
        lens = torch.full((batch,), length, dtype=torch.int32, device=device)
        out = paged_attention(
            q, k_pages, v_pages, table, lens, sinks, k_scales=k_scale_pages,
            v_scales=v_scale_pages, **options,
        )  # fmt: skip
    else:
        index = (first[:, None] + torch.arange(length, device=device)).reshape(-1)
        k, k_scales = read_tokens(k_pages, 0, index, k_scale_pages)
        v, v_scales = read_tokens(v_pages, 0, index, v_scale_pages)
        steps = torch.arange(batch + 1, dtype=torch.int32, device=device)
        out = ragged_attention(
            q, k, v, steps * tokens, steps * length, sinks, k_scales=k_scales, v_scales=v_scales,
            causal=True, **options,
        )  # fmt: skip
    return out.view(batch, tokens, heads, -1), None


def _check_static_mask(op: str, attention_mask, batch: int, keys: int) -> None:
    """Every key of a static batch is real: no mask, or a [B, keys] mask of ones (what
    Transformers hands a flash-named attention with a static cache)."""
    if attention_mask is None:
        return
    if attention_mask.dim() != 2 or tuple(attention_mask.shape) != (batch, keys):
        raise KernelInputError(
            f"{op}: attention_mask {tuple(attention_mask.shape)} must be the [batch, keys] = "
            f"({batch}, {keys}) padding mask Transformers passes a flash-named attention"
        )
    if not bool(attention_mask.bool().all()):
        raise KernelInputError(
            f"{op}: the attention mask pads some sequences; the static serving cache holds "
            "sequences of one length (pass prompts of equal length, or use generate_batch, "
            "whose requests need no padding)"
        )


def _history(kv_pages, offsets, key, value, scale_pages, kwargs):
    """Write the new tokens into the cache, then read every request's keys and values (with
    their scales, 8-bit) at ``kv_read_index`` (the new tokens alone when it is empty)."""
    write, read = kwargs.get("kv_write_index"), kwargs.get("kv_read_index")
    if write is None:
        raise KernelInputError(
            "continuous_batching_attention: kv_pages came without kv_write_index or a "
            "block_table (kernel-hub's serving cache hands over one of them)"
        )
    write_tokens(kv_pages, offsets, key, value, write, scale_pages)
    index = write if read is None or read.numel() == 0 else read
    key, k_scales = read_tokens(kv_pages, offsets[0], index, scale_pages)
    value, v_scales = read_tokens(kv_pages, offsets[1], index, scale_pages)
    return key, value, {"k_scales": k_scales, "v_scales": v_scales}


def register(name: str = DEFAULT_NAME) -> str:
    """Register ``continuous_batching_attention`` under ``name`` (which must contain "flash")."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    if "flash" not in name:
        raise KernelInputError(
            f"register({name!r}): continuous batching accepts only names containing 'flash'"
        )
    AttentionInterface.register(name, continuous_batching_attention)
    AttentionMaskInterface.register(name, flash_attention_mask)
    return name
