"""Diffusers integration: this kernel as an attention backend of Diffusers' dispatcher.

Diffusers' newer models (Flux, Flux2, Wan, QwenImage, HunyuanVideo, LTX, ...) call
``dispatch_attention_fn(q, k, v, backend=processor._attention_backend, ...)`` with q/k/v in
[B, S, H, D]. ``register()`` registers ``attention`` as a backend and returns its key; kernel-hub
then sets that key on each processor *instance* it switches (``kernel_hub.layers.integrations
.diffusers``). Diffusers' public setters accept only members of its closed
``AttentionBackendName`` enum; the key is an instance of that enum class that is *not* added to
the enum (its member maps stay as they are), one per loaded build of this kernel, registered in
``_AttentionBackendRegistry`` (private API), where nothing else can look it up.

The dispatcher drops every keyword its backend does not declare, silently. The backend is
therefore registered as accepting every name, and itself refuses what it does not implement.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

from kernel_hub.kernel_api import KernelInputError

from . import torch_api

log = logging.getLogger(__name__)

# What kernelize() reads (``FrameworkAdapter``): the ops have backward ops and trace into one
# torch.compile graph; each processor is judged by kernel-hub's dispatcher interface instead.
has_backward = True
can_torch_compile = True
module_problem = None

HONOURED = (
    "query",
    "key",
    "value",
    "attn_mask",
    "dropout_p",
    "is_causal",
    "scale",
    "enable_gqa",
    "return_lse",
    "_parallel_config",
)
"""Diffusers' backend arguments ``attention`` takes (the last two only to refuse them)."""


class _EveryName(frozenset):
    """Argument names of a backend that takes every keyword (and refuses what it cannot do)."""

    def __contains__(self, name: object) -> bool:
        return True


def _backend_key(name: str) -> AttentionBackendName:
    """An ``AttentionBackendName`` instance outside the enum's members (see the module doc)."""
    key = str.__new__(AttentionBackendName, name)
    key._name_ = key._value_ = name
    return key


KEY = _backend_key(f"kernel_hub:{__package__}")
"""This build's backend key (a build's package name is unique to it)."""


def register() -> AttentionBackendName:
    """Register ``attention`` under this build's private key, once."""
    registry = _AttentionBackendRegistry
    if KEY not in registry._backends:
        registry.register(KEY)(attention)
        registry._supported_arg_names[KEY] = _EveryName(HONOURED)
    return KEY


def _sdpa_mask_4d(mask: torch.Tensor, batch: int, kv_len: int) -> torch.Tensor:
    """A mask as SDPA reads it, made 4-D: Diffusers' native backend turns a [B, S_k] mask into
    key padding [B, 1, 1, S_k]; any other rank broadcasts from the right."""
    if mask.dim() == 2 and tuple(mask.shape) == (batch, kv_len):
        return mask[:, None, None, :]
    if not 1 <= mask.dim() <= 4:
        raise KernelInputError(
            f"attention: attn_mask has shape {tuple(mask.shape)}; expected 1 to 4 dims "
            "broadcasting to [batch, heads, q_len, kv_len]"
        )
    return mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    _parallel_config: Any = None,
    **unknown: Any,
) -> torch.Tensor:
    """Diffusers' backend contract: q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D] -> [B, Sq, Hq, D]."""
    refused = {name: v for name, v in unknown.items() if v is not None}
    if return_lse:
        refused["return_lse"] = True
    if _parallel_config is not None:
        refused["_parallel_config"] = type(_parallel_config).__name__
    if refused:
        raise KernelInputError(
            f"attention: kernel-hub's Diffusers backend does not implement {refused}; it "
            f"honours {', '.join(HONOURED[:-2])}. Run this model with "
            "kernel_hub.unkernelize(model) or another Diffusers backend"
        )
    q_heads, kv_heads = query.shape[2], key.shape[2]
    if q_heads != kv_heads and not enable_gqa:
        raise KernelInputError(
            f"attention: query has {q_heads} heads and key/value {kv_heads}; Diffusers passes "
            "enable_gqa=True for grouped-query attention, and SDPA refuses this call too"
        )
    if attn_mask is not None and is_causal:
        raise KernelInputError("attention: attn_mask together with is_causal=True (SDPA too)")
    if is_causal and query.shape[1] != key.shape[1]:
        raise KernelInputError(
            f"attention: is_causal=True with q_len {query.shape[1]} != kv_len "
            f"{key.shape[1]}; SDPA's top-left causal mask for that case is not implemented"
        )
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    mask = None if attn_mask is None else _sdpa_mask_4d(attn_mask, q.shape[0], k.shape[2])
    if dropout_p > 0.0 and not (mask is None or _key_padding(mask)):
        log.warning(
            "attention: dropout_p=%s > 0 with a dense attn_mask runs torch SDPA (the kernel's "
            "dropout takes no dense mask)",
            dropout_p,
        )
        out = torch.nn.functional.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=dropout_p,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=enable_gqa,
        )
    else:
        out = _kernel_attention(q, k, v, mask, is_causal, scale, dropout_p)
    return out.transpose(1, 2)


def _key_padding(mask: torch.Tensor) -> bool:
    """Whether a 4-D mask is key padding alone (boolean, one row for every head and query)."""
    return mask.dtype == torch.bool and mask.shape[1] == mask.shape[2] == 1


def _kernel_attention(q, k, v, mask, causal, scale, dropout_p):
    """q [B, Hq, Sq, D], k/v [B, Hkv, Sk, D] through the kernel's torch ops; ``mask`` 4-D or
    None; dropout (in the kernel, seeded from torch's generator) only without a dense mask."""
    drop = {}
    if dropout_p > 0.0:
        drop = {"dropout_rate": dropout_p, "dropout_seed": torch_api.dropout_seed(q.device)}
    if mask is None:
        return torch_api.dot_product_attention(q, k, v, causal=causal, scale=scale, **drop)
    batch, heads, q_len, kv_len = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    if _key_padding(mask):
        kv_mask = mask[:, 0, 0, :].expand(batch, kv_len)  # key padding: the kernel's own mask
        return torch_api.dot_product_attention(q, k, v, kv_mask, scale=scale, **drop)
    m_batch, m_heads = mask.shape[0], mask.shape[1]
    dense = mask.expand(m_batch, heads if m_heads != 1 else 1, q_len, kv_len)
    return torch_api.attention_with_dense_mask(q, k, v, dense, scale=scale)[0]
