"""Transformers continuous batching: an ``AttentionInterface`` function for ``generate_batch``.

Continuous batching (``model.generate_batch``, ``init_continuous_batching``) accepts only
``sdpa``, ``paged|eager`` or a name containing "flash", and calls a flash-named function with
``attention_mask=None`` and the batch described by keyword arguments. Two call shapes arrive:

* index path (every prefill, mixed and decode batch by default): q [1, Hq, T, D] with all
  requests packed, k/v [1, Hkv, N, D] each request's whole history read back from the cache,
  ``cu_seq_lens_q/k`` [S+1]; this runs ``ragged_attention``.
* block-table path (decode batches, when ``max_blocks_per_request > 0``): one new token per
  request, the cache's per-layer page views ``k_cache``/``v_cache`` [P, page, Hkv, D] and this
  layer group's ``block_table`` [S, max_blocks]; Transformers does NOT write the new K/V here.
  ``continuous_batching_attention`` writes them into the pages with ``index_copy_`` (as the index
  path does), then runs ``paged_attention`` on the pages in place.

With an 8-bit KV cache (kernel-hub's ``generate_batch(..., kv_cache_dtype=...)``: its cache
holds float8_e4m3fn or int8 K/V and f32 scale pages [P, Hkv, page], ``kv_quant``), the cache
update hands over ``k_scale_cache``/``v_scale_cache`` and, on the index path, the layer's token
views ``k_cache``/``v_cache`` with ``kv_write_index``/``kv_read_index`` instead of writing: this
function quantizes the new K/V on write (``kv_quant.quantize``) on both paths; the index path
reads each request's 8-bit history and its scales back for ``ragged_attention``, the
block-table path runs ``paged_attention`` on the 8-bit pages (both kernels dequantize inside).

Outside a continuous-batching call (no ``cu_seq_lens_q``) the function refuses: kernel-hub
switches a model to it only for the life of a batching manager (see kernel-hub's Transformers
integration). Arguments it does not implement are refused by name, never ignored.
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
    "k_cache",
    "v_cache",
    "k_scale_cache",
    "v_scale_cache",
    "kv_write_index",
    "kv_read_index",
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


def write_tokens(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slots: torch.Tensor,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> None:
    """Write key/value [T, Hkv, D] at token ``slots`` [T] of the layer's flat token view of
    ``k_cache``/``v_cache`` (pages [P, page, Hkv, D] or tokens [N, Hkv, D]). With scale pages
    [P, Hkv, page] the cache is 8-bit: quantize on write (``kv_quant.quantize``), the scale of
    token ``t`` at ``[t // page, :, t % page]``. In place; these are views of the cache."""
    for cache, scales, states in ((k_cache, k_scales, key), (v_cache, v_scales, value)):
        tokens = cache.view(-1, *cache.shape[-2:])
        if scales is None:
            tokens.index_copy_(0, slots, states.to(cache.dtype))
            continue
        values, scale = kv_quant.quantize(states, cache.dtype)
        # as bytes: torch's CPU index_copy_ / index_select take no float8
        tokens.view(torch.uint8).index_copy_(0, slots, values.view(torch.uint8))
        page = scales.shape[2]
        scales[slots // page, :, slots % page] = scale


def read_tokens(
    cache: torch.Tensor, scales: torch.Tensor, index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens ``index`` of an 8-bit token view: values [len(index), Hkv, D] and their scales
    [Hkv, len(index)] (``ragged_attention``'s layout)."""
    page = scales.shape[2]
    values = cache.view(torch.uint8).index_select(0, index).view(cache.dtype)
    return values, scales[index // page, :, index % page].T.contiguous()


def decode_slots(block_table: torch.Tensor, kv_lens: torch.Tensor, page: int) -> torch.Tensor:
    """Token slot of each sequence's newest token: position ``kv_lens[s] - 1`` lives at
    ``block_table[s, pos // page] * page + pos % page`` of the layer's flat token view."""
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
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is None or cu_k is None:
        raise KernelInputError(
            "continuous_batching_attention serves continuous batching calls (with cu_seq_lens_q "
            "and cu_seq_lens_k); this call has none. Outside generate_batch the model runs its "
            "own attention implementation."
        )
    if attention_mask is not None:
        raise KernelInputError(
            "continuous_batching_attention: got an attention mask; continuous batching with a "
            "flash-named implementation passes none (the batch is described by cu_seq_lens)"
        )
    if dropout > 0.0:
        raise KernelInputError(
            f"continuous_batching_attention: dropout={dropout} is not supported (serving)"
        )
    if query.shape[0] != 1:
        raise KernelInputError(
            f"continuous_batching_attention: query {tuple(query.shape)} must pack every request "
            "into one row (batch 1), as continuous batching does"
        )
    is_causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    window = _kernel_window(sliding_window, causal)
    sinks = kwargs.get("s_aux")
    q = query[0].transpose(0, 1)  # [T, Hq, D]
    options = dict(sliding_window=window, softcap=softcap, scale=scaling)
    block_table = kwargs.get("block_table")
    key, value = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T or N, Hkv, D]
    k_cache, v_cache = kwargs.get("k_cache"), kwargs.get("v_cache")
    scales = {"k_scales": kwargs.get("k_scale_cache"), "v_scales": kwargs.get("v_scale_cache")}
    if (k_cache is None or v_cache is None) and (
        block_table is not None or any(s is not None for s in scales.values())
    ):
        raise KernelInputError(
            "continuous_batching_attention: a block_table or cache scales came without "
            "k_cache/v_cache"
        )
    if block_table is not None:
        kv_lens = _decode_lengths(cu_q, cu_k, q.shape[0])
        check_paged_values(block_table, kv_lens, k_cache)
        slots = decode_slots(block_table, kv_lens, k_cache.shape[1])
        write_tokens(k_cache, v_cache, key, value, slots, **scales)
        out = paged_attention(q, k_cache, v_cache, block_table, kv_lens, sinks, **scales, **options)
        return out.unsqueeze(0), None
    if kwargs.get("kv_write_index") is not None:  # 8-bit cache, index path: write, read back
        key, value, scales = _quantized_history(k_cache, v_cache, key, value, scales, kwargs)
    out = ragged_attention(q, key, value, cu_q, cu_k, sinks, **scales, causal=causal, **options)
    return out.unsqueeze(0), None


def _quantized_history(k_cache, v_cache, key, value, scales, kwargs):
    """Write the new tokens into the 8-bit cache, then read every request's 8-bit keys and
    values with their scales (``kv_read_index``; the new tokens alone when it is empty)."""
    if scales["k_scales"] is None or scales["v_scales"] is None:
        raise KernelInputError(
            "continuous_batching_attention: kv_write_index came without k_scale_cache/"
            "v_scale_cache (only an 8-bit cache hands over its write index)"
        )
    write, read = kwargs["kv_write_index"], kwargs.get("kv_read_index")
    write_tokens(k_cache, v_cache, key, value, write, **scales)
    index = write if read is None or read.numel() == 0 else read
    key, k_scales = read_tokens(k_cache, scales["k_scales"], index)
    value, v_scales = read_tokens(v_cache, scales["v_scales"], index)
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
