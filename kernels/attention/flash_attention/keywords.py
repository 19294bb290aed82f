"""Which keyword arguments of Transformers' attention calls the integration honours, which are
harmless to ignore, and which it refuses: nothing that changes the math is dropped silently.

``attention_forward`` names every keyword it honours as a parameter. The rest reach it through
``**kwargs`` and go through ``check_call``: a keyword in ``HARMLESS`` is ignored (it describes
something the query, key, value and mask already encode), one in ``REFUSED`` raises with the
feature it stands for, and any other keyword raises unless its value is None. ``module_problem``
reads, without running it, which keywords a module's forward passes by name, so ``kernelize`` can
leave a model alone before its first call.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Mapping
from typing import Any

import torch

from kernel_hub.kernel_api import KernelInputError

HONOURED = (
    "attention_mask",
    "dropout",
    "scaling",
    "sliding_window",
    "softcap",
    "is_causal",
    "s_aux",
    "position_bias",
)
"""Parameters of ``attention_forward``: each changes what it computes."""

HARMLESS = {
    "position_ids": "positions are already applied to q/k (RoPE); packing is in the mask",
    "cache_position": "cache slots are already written; the mask holds the visible keys",
    "use_cache": "caching happens before the attention call",
    "output_router_logits": "a flag for the MoE layers, not for attention",
    "output_hidden_states": "a flag for the model's outputs",
    "return_dict": "a flag for the model's outputs",
    "encoder_hidden_states": "cross-attention keys and values are already projected",
    "max_length_q": "flash-attention varlen metadata; lengths are in the tensors",
    "max_length_k": "flash-attention varlen metadata; lengths are in the tensors",
    "cu_seq_lens_q": "packed sequences, honoured through the mask (see check_call)",
    "cu_seq_lens_k": "packed sequences, honoured through the mask (see check_call)",
    "output_attentions": "attention weights are never returned (None), with a warning",
    "num_items_in_batch": "Trainer's token count for the loss; the loss reads it, not attention",
    "deterministic": "flash-attention's deterministic-backward flag (ModernBERT); the kernel is",
    "logits_to_keep": "which rows the LM head keeps (LLaVA-OneVision passes it down every layer)",
}
"""Keywords that may be ignored, with why."""

REFUSED = {
    "sinks": "attention sinks under the name 'sinks' (kernel-hub honours GPT-OSS's s_aux)",
    "indices": "sparse attention over selected keys (DeepSeek-V3.2-style indexer)",
    "block_indices": "block-sparse attention over selected key blocks",
    "head_mask": "a per-head multiplier on the attention probabilities",
    "attention_chunk_size": "chunked local attention",
}
"""Keywords whose feature the kernel does not implement, with the feature."""


def _refusal(name: str, why: str) -> str:
    return (
        f"attention: keyword {name!r} ({why}) is not implemented by kernel-hub attention; "
        f"run this model with attn_implementation='sdpa' or 'eager' (kernelize leaves such "
        f"models alone)"
    )


def check_call(kwargs: Mapping[str, Any], attention_mask: torch.Tensor | None) -> None:
    """Raise ``KernelInputError`` for a keyword that would change the result if ignored."""
    for name, value in kwargs.items():
        if name in REFUSED:
            if value is not None:
                raise KernelInputError(_refusal(name, REFUSED[name]))
        elif name.startswith("cu_seq_lens_"):
            _check_packing(name, value, attention_mask)
        elif name not in HARMLESS and value is not None:
            raise KernelInputError(
                f"attention: unknown keyword {name!r}={_describe(value)}; kernel-hub attention "
                f"honours {', '.join(HONOURED)} and ignores {', '.join(sorted(HARMLESS))}. An "
                f"unknown argument may change the result, so it is refused rather than ignored"
            )


def _check_packing(name: str, value: Any, attention_mask: torch.Tensor | None) -> None:
    """``cu_seq_lens_*`` with several sequences is harmless only when a mask encodes them."""
    several = isinstance(value, torch.Tensor) and value.numel() > 2
    if several and attention_mask is None:
        raise KernelInputError(
            f"attention: {name} describes {value.numel() - 1} packed sequences but no attention "
            f"mask encodes them; pass position_ids so Transformers builds the packed mask"
        )


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"<tensor {tuple(value.shape)} {value.dtype}>"
    return repr(value)[:60]


def _keyword_names(fn: Any) -> set[str]:
    """Keyword names ``fn`` (and the functions it wraps) passes in calls (CPython ``KW_NAMES``
    constants are tuples of strings)."""
    names: set[str] = set()
    while fn is not None:
        code = getattr(fn, "__code__", None)
        if code is not None:
            for const in code.co_consts:
                if isinstance(const, tuple) and all(isinstance(c, str) for c in const):
                    names.update(const)
        fn = getattr(fn, "__wrapped__", None)
    return names


_SOFTCAP_ATTRIBUTES = ("attn_logit_softcapping", "softcap", "logit_softcapping")


def soft_caps(module: torch.nn.Module) -> bool:
    """Whether the module holds a soft-cap value (the attribute names models use)."""
    return any(getattr(module, a, None) is not None for a in _SOFTCAP_ATTRIBUTES)


_MASK_AS_TENSOR = re.compile(r"\battention_mask\s*(\.(?!__)\w+|\[)")


def _mask_tensor_problem(module: torch.nn.Module) -> str | None:
    """The integration hands attention a mask description, not a tensor: a module whose forward
    reads the mask as a tensor (Qwen4-Exp re-masks its selected keys by the mask's dtype) or takes
    a mask its model concatenated from two (T5Gemma 2's merged self + cross attention) fails."""
    forward = getattr(type(module), "forward", None)
    try:
        source = inspect.getsource(forward)
    except (OSError, TypeError):
        return None
    if "merged_attention_mask" in inspect.signature(forward).parameters:
        return (
            f"{type(module).__name__}.forward takes merged_attention_mask: its model "
            "concatenates the self- and cross-attention masks as tensors, and kernel-hub's mask "
            "function returns a mask description"
        )
    used = _MASK_AS_TENSOR.search(source)
    if used is None or "isinstance(attention_mask" in source:
        return None
    return (
        f"{type(module).__name__}.forward reads the attention mask as a tensor "
        f"({used.group(0)}...), and kernel-hub's mask function returns a mask description"
    )


def module_problem(module: torch.nn.Module) -> str | None:
    """Why ``module``'s attention cannot run on this kernel, or None: its forward passes a
    refused keyword by name or reads the mask as a tensor."""
    names = _keyword_names(getattr(type(module), "forward", None))
    passed = names & REFUSED.keys()
    if passed:
        features = "; ".join(f"{name!r}: {REFUSED[name]}" for name in sorted(passed))
        return f"{type(module).__name__}.forward passes {features}, not implemented by the kernel"
    return _mask_tensor_problem(module)
