"""flash-attn's entry points, for Transformers' hub attention (``attn_implementation="org/repo"``).

Transformers loads a hub attention kernel with Hugging Face ``kernels`` and, when the module has
``flash_attn_varlen_func``, drives it exactly as it drives flash-attention 2
(``modeling_flash_attention_utils._flash_attention_forward``): a left/right-padded batch is
unpadded into one token stream with ``cu_seqlens`` and sent to ``flash_attn_varlen_func``, an
unpadded batch goes to ``flash_attn_func``; q/k/v are [.., seq, heads, head_dim]. Which keywords
it sends depends on this module's signatures (a ``softcap`` a kernel does not take is refused by
Transformers, an ``s_aux`` it does not take is dropped silently), so both functions take every
flash-attn argument Transformers can send and refuse the ones they do not serve exactly.

Both run this kernel's ``dot_product_attention`` op: the varlen call as one row of packed
sequences, each sequence a segment, with the positions the causal/window rule reads (queries
aligned to the end of their keys, flash-attn's bottom-right convention), so nothing crosses
sequences and no host sync is needed.
"""

from __future__ import annotations

import torch

from kernel_hub.kernel_api import KernelInputError

from .torch_api import dot_product_attention

_NAME = "kernel-hub attention (flash-attn API)"


def _refuse(condition: bool, message: str) -> None:
    if condition:
        raise KernelInputError(f"{_NAME}: {message}")


def _options(
    dropout_p: float,
    softmax_scale: float | None,
    causal: bool,
    window_size: tuple[int, int],
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    return_attn_probs: bool,
) -> dict:
    """flash-attn's arguments as ``AttentionSpec`` options, or a refusal naming what is served."""
    _refuse(
        dropout_p != 0.0,
        f"dropout_p={dropout_p}; attention dropout is not served (only 0.0): train with "
        "attention_dropout=0 or use attn_implementation='eager'",
    )
    _refuse(alibi_slopes is not None, "alibi_slopes is not served (only None)")
    _refuse(return_attn_probs, "return_attn_probs=True is not served (flash-attn never forms them)")
    left, right = (int(w) for w in window_size)
    _refuse(
        left < -1 or right < -1,
        f"window_size={tuple(window_size)}; each side is -1 (unbounded) or a number of tokens >= 0",
    )
    _refuse(  # flash-attn ignores the right side under causal masking
        not causal and left != right,
        f"window_size={tuple(window_size)} without causal; only symmetric windows (w, w) "
        "or (-1, -1) are served",
    )
    sliding_window = None if left == -1 else left + 1
    _refuse(softcap < 0, f"softcap={softcap}; 0.0 (none) or a number > 0")
    return dict(
        causal=bool(causal),
        sliding_window=sliding_window,
        softcap=None if softcap == 0.0 else float(softcap),
        scale=None if softmax_scale is None else float(softmax_scale),
    )


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(-3, -2)


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    s_aux: torch.Tensor | None = None,
) -> torch.Tensor:
    """flash-attn's ``flash_attn_func``: q [B, Sq, Hq, D], k [B, Sk, Hkv, D], v [B, Sk, Hkv, Dv]
    -> out [B, Sq, Hq, Dv]. ``s_aux`` [Hq] are attention-sink logits (GPT-OSS); this kernel is
    deterministic, so ``deterministic`` asks for nothing more."""
    options = _options(
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs
    )
    _check_layout("flash_attn_func", q, k, v, rank=4)
    out = dot_product_attention(
        _heads_first(q), _heads_first(k), _heads_first(v), sinks=s_aux, **options
    )
    return _heads_first(out)


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int | torch.Tensor,
    max_seqlen_k: int | torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: torch.Tensor | None = None,
    s_aux: torch.Tensor | None = None,
) -> torch.Tensor:
    """flash-attn's ``flash_attn_varlen_func``: packed q [Tq, Hq, D], k [Tk, Hkv, D],
    v [Tk, Hkv, Dv]; sequence ``b`` is rows ``cu_seqlens[b]:cu_seqlens[b + 1]`` (int32 [B + 1],
    from 0); -> out [Tq, Hq, Dv]. Query ``i`` of a sequence sits at key position
    ``i + len_k - len_q``. ``max_seqlen_*`` are block-size hints to flash-attn, unused here (the
    lengths come from ``cu_seqlens``). ``cu_seqlens`` that do not start at 0, decrease or do not
    end at the token count are refused (``_check_offsets``)."""
    options = _options(
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs
    )
    _refuse(
        block_table is not None,
        "block_table (a paged KV cache) is not served here; kernel-hub's ragged-attention "
        "kernel serves paged decoding (kernel_hub.kernelize's continuous batching)",
    )
    _check_layout("flash_attn_varlen_func", q, k, v, rank=3)
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        _refuse(
            cu.dim() != 1 or cu.shape[0] < 2 or cu.dtype not in (torch.int32, torch.int64),
            f"{name} has shape {tuple(cu.shape)} and dtype {cu.dtype}; expected int32 "
            "[batch + 1] cumulative sequence lengths starting at 0",
        )
    _refuse(
        cu_seqlens_q.shape != cu_seqlens_k.shape,
        f"cu_seqlens_q {tuple(cu_seqlens_q.shape)} and cu_seqlens_k {tuple(cu_seqlens_k.shape)} "
        "must describe the same number of sequences",
    )
    _check_offsets("cu_seqlens_q", cu_seqlens_q, q.shape[0])
    _check_offsets("cu_seqlens_k", cu_seqlens_k, k.shape[0])
    q_segments, q_index = _segments(cu_seqlens_q, q.shape[0])
    kv_segments, kv_index = _segments(cu_seqlens_k, k.shape[0])
    lengths_q = _lengths(cu_seqlens_q)
    lengths_k = _lengths(cu_seqlens_k)
    q_positions = q_index + (lengths_k - lengths_q)[q_segments]
    out = dot_product_attention(
        _heads_first(q)[None],
        _heads_first(k)[None],
        _heads_first(v)[None],
        None,
        q_segments[None],
        kv_segments[None],
        sinks=s_aux,
        q_positions=q_positions[None],
        kv_positions=kv_index[None],
        **options,
    )
    return _heads_first(out[0])


def _check_offsets(name: str, cu_seqlens: torch.Tensor, total: int) -> None:
    """Refuse offsets that would mix or drop tokens: they start at 0, never decrease and end at
    the token count. Host values are read at once (a ``KernelInputError`` before any kernel
    runs); device values, or values inside a compiled graph, are checked by an assertion that
    runs with the graph (an error, never a silent result) without a host sync."""
    valid = (cu_seqlens[0] == 0) & (cu_seqlens[-1] == total) & (cu_seqlens.diff() >= 0).all()
    rule = f"cumulative sequence lengths start at 0, never decrease and end at the {total} tokens"
    if cu_seqlens.device.type == "cpu" and not torch.compiler.is_compiling():
        _refuse(not bool(valid), f"{name}={cu_seqlens.tolist()}; {rule}")
    else:
        torch._assert_async(valid, f"{_NAME}: {name}: {rule}")


def _segments(cu_seqlens: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each packed row's sequence number and index within it."""
    rows = torch.arange(total, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    segments = torch.searchsorted(cu_seqlens[1:], rows, right=True)
    index = rows - cu_seqlens[segments]
    return segments.to(torch.int32), index.to(torch.int32)


def _lengths(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Sequence lengths, with a 0 for the rows past the last end."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int32)
    return torch.cat([lengths, lengths.new_zeros(1)])


def _check_layout(
    function: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, rank: int
) -> None:
    layout = "[batch, seq, heads, head_dim]" if rank == 4 else "[tokens, heads, head_dim]"
    for name, x in (("q", q), ("k", k), ("v", v)):
        _refuse(
            x.dim() != rank,
            f"{function}: {name} has shape {tuple(x.shape)}; expected {layout}",
        )
