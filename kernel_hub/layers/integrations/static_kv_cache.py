"""An 8-bit static KV cache for ``generate``, read in place by kernel-hub's serving attention.

Opt-in and lossy, on a kernelized model::

    with static_kv_cache(model, "float8_e4m3fn"):  # or "int8"
        out = model.generate(ids, cache_implementation="static", ...)

Inside the block, ``generate``'s static cache is a ``ServingStaticCache``: Transformers'
``StaticCache`` (same length bookkeeping) whose layers hold their keys and values as 8-bit pages
plus one f32 scale per token and kv head (the ragged-attention kernel's ``kv_quant`` format, the
same as the continuous-batching cache's), and the model's attention is the ragged-attention
kernel's serving function, which writes the new tokens (quantizing them) and reads the cache:
``paged_attention`` on the pages in place for a decode step, ``ragged_attention`` on each
sequence's keys read back for a prefill. Both kernels dequantize in VMEM. On leaving the block
the model's attention and ``generate``'s cache are restored.

Layout of a layer (batch B, ``n`` pages of ``page_size`` tokens per sequence, ``n * page_size >=
max_cache_len``): ``k_pages`` and ``v_pages`` [B * n, page, Hkv, D], sequence ``b`` owning pages
``b * n`` to ``b * n + n - 1`` (a static cache's ``[B, L, Hkv, D]`` in page form, so a decode
step's block table is fixed), and ``k_scale_pages`` and ``v_scale_pages`` [B * n, Hkv, page].
Keys and values are separate tensors, so a decode step hands the kernel the cache itself, never a
slice (under torchax a slice or view is a copy).

Refused, with the reason: a model that was not kernelized, an encoder-decoder, layer types
other than full attention (sliding windows keep a ring buffer), a cache other than ``"static"``
inside the block, beam search (``reorder_cache``), more tokens than the cache holds, and padded
batches (the attention refuses a mask with a zero: every sequence of a static batch has one
length). Not ``torch.compile``-able (the serving
attention runs eagerly). Written against Transformers 5.24's ``StaticCache`` and
``_prepare_static_cache``.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator
from typing import Any

import torch

from kernel_hub.errors import KernelHubError

from .continuous_batching import serving_attention
from .serving_cache import FULL_ATTENTION
from .serving_cache import kv_cache_dtype as _kv_dtype

_PREPARE = "_prepare_static_cache"
"""The ``generate`` hook replaced on the instance inside ``static_kv_cache``."""
DEFAULT_PAGE_SIZE = 256
"""Tokens a page holds unless asked otherwise (fewer for a shorter cache; see ``page_size``)."""


def choose_page_size(max_cache_len: int, requested: int | None = None) -> int:
    """``requested``, or the default: 256 tokens, or the cache length rounded up to a power of
    two (at least 32, the 8-bit sublane tile) when that is shorter."""
    if requested is not None:
        if requested < 1:
            raise KernelHubError(f"page_size={requested} must be >= 1")
        return requested
    return min(DEFAULT_PAGE_SIZE, max(32, 1 << (max(max_cache_len, 1) - 1).bit_length()))


@functools.cache
def static_cache_class() -> type:
    """``ServingStaticCache`` (defined on first use: it subclasses Transformers classes)."""
    from transformers.cache_utils import StaticCache, StaticLayer

    class ServingStaticLayer(StaticLayer):
        """A ``StaticLayer`` whose keys and values are 8-bit pages with scales; its ``update``
        writes nothing and hands the layer and the new tokens to the serving attention."""

        def __init__(self, max_cache_len: int, *, dtype: torch.dtype, page: int) -> None:
            super().__init__(max_cache_len=max_cache_len)
            self.kv_dtype, self.page = dtype, page
            self.pages_per_sequence = math.ceil(max_cache_len / page)
            self.length = 0
            """Keys per sequence (``cumulative_length`` on the host: read without a sync)."""

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor):
            batch, kv_heads, _, dim = key_states.shape
            if value_states.shape[-1] != dim:
                raise KernelHubError(
                    f"the static serving cache holds keys and values of one head dim; got "
                    f"{dim} and {value_states.shape[-1]}"
                )
            self.device, self.batch_size, self.num_heads = key_states.device, batch, kv_heads
            self.k_head_dim = self.v_head_dim = dim
            pages = batch * self.pages_per_sequence
            shape, scale_shape = (pages, self.page, kv_heads, dim), (pages, kv_heads, self.page)
            self.k_pages, self.v_pages = (
                torch.zeros(shape, dtype=self.kv_dtype, device=self.device) for _ in "kv"
            )
            self.k_scale_pages, self.v_scale_pages = (
                torch.ones(scale_shape, dtype=torch.float32, device=self.device) for _ in "kv"
            )
            self.keys, self.values = self.k_pages, self.v_pages
            self.cumulative_length = self.cumulative_length.to(self.device)
            self.is_initialized = True

        def update(
            self,
            key_states: torch.Tensor,
            value_states: torch.Tensor,
            cache_kwargs: dict[str, Any] | None = None,
            *,
            kwargs: dict[str, Any] | None = None,
        ) -> tuple[torch.Tensor, torch.Tensor]:
            """Count the new tokens and hand the layer and them to the attention (through the
            layer's ``kwargs``, which the model passes on to its attention function). Returns
            the 8-bit key and value pages: an attention other than kernel-hub's serving one
            fails on them."""
            if kwargs is None:
                raise KernelHubError(
                    "the static serving cache needs a model that passes its attention kwargs to "
                    "cache.update(..., kwargs=kwargs) (as Transformers 5.24's Llama does); this "
                    f"one passed {'cache_kwargs' if cache_kwargs is not None else 'none'}"
                )
            tokens = key_states.shape[-2]
            if self.length + tokens > self.max_cache_len:
                raise KernelHubError(
                    f"the static serving cache holds {self.max_cache_len} tokens a sequence; "
                    f"{self.length} are cached and {tokens} more came"
                )
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            self.length += tokens
            self.cumulative_length.add_(tokens)
            kwargs["static_kv_cache"] = self
            kwargs["static_kv_new"] = (key_states, value_states)
            return self.keys, self.values

        def reset(self) -> None:
            if self.is_initialized:
                for pages, scales in (
                    (self.k_pages, self.k_scale_pages),
                    (self.v_pages, self.v_scale_pages),
                ):
                    pages.view(torch.uint8).zero_()
                    scales.fill_(1.0)
            self.cumulative_length.zero_()
            self.length = 0

        def crop(self, tokens_to_remove: int) -> None:
            super().crop(tokens_to_remove)
            self.length -= abs(tokens_to_remove)

        def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
            raise KernelHubError("the static serving cache does not reorder beams (beam search)")

    class ServingStaticCache(StaticCache):
        """Transformers' ``StaticCache`` of ``ServingStaticLayer``s (every layer full attention)."""

        def __init__(
            self,
            config: Any,
            max_cache_len: int,
            *,
            kv_cache_dtype: str,
            page_size: int | None = None,
        ) -> None:
            from transformers import Cache
            from transformers.cache_utils import get_layer_types_and_kwargs

            dtype = _kv_dtype(kv_cache_dtype)
            layer_types, _ = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
            others = sorted(set(layer_types) - {FULL_ATTENTION})
            if others:
                raise KernelHubError(
                    f"the static serving cache holds full-attention layers only; this model has "
                    f"{', '.join(others)} layers"
                )
            page = choose_page_size(max_cache_len, page_size)
            layer = functools.partial(ServingStaticLayer, max_cache_len, dtype=dtype, page=page)
            Cache.__init__(self, layers=[layer() for _ in layer_types])

    return ServingStaticCache


@contextlib.contextmanager
def static_kv_cache(
    model: torch.nn.Module, kv_cache_dtype: str, *, page_size: int | None = None
) -> Iterator[None]:
    """Inside the block, ``model.generate(..., cache_implementation="static")`` keeps its KV
    cache in ``kv_cache_dtype`` ("float8_e4m3fn" or "int8", one f32 scale per token and kv head)
    and kernel-hub's serving attention reads it (see the module docstring). ``model`` must be
    kernelized; ``page_size`` (default: ``choose_page_size``) is the paged kernel's page."""
    _kv_dtype(kv_cache_dtype)
    name = serving_attention(model)
    if name is None:
        raise KernelHubError(
            f"kv_cache_dtype={kv_cache_dtype!r} needs a kernelized model: only kernel-hub's "
            "serving attention reads an 8-bit KV cache (kernelize(model) first)"
        )
    if getattr(model.config, "is_encoder_decoder", False):
        raise KernelHubError(
            f"the static serving cache holds a decoder's self-attention; {type(model).__name__} "
            "is an encoder-decoder (its cross-attention cache would stay Transformers')"
        )
    if _PREPARE in model.__dict__:
        raise KernelHubError("static_kv_cache blocks do not nest on one model")
    build = static_cache_class()

    def prepare(cache_implementation: str, batch_size: int, max_cache_len: int, *args, **kw):
        if cache_implementation != "static":
            raise KernelHubError(
                f"inside static_kv_cache, generate's cache_implementation must be 'static' "
                f"(got {cache_implementation!r})"
            )
        length = max(max_cache_len, getattr(model, "_previous_max_cache_length", -1))
        model._previous_max_cache_length = length
        config = model.config
        return build(config, length, kv_cache_dtype=kv_cache_dtype, page_size=page_size)

    previous = model.config._attn_implementation
    model.__dict__[_PREPARE] = prepare
    model.config._attn_implementation = name
    try:
        yield
    finally:
        model.config._attn_implementation = previous
        model.__dict__.pop(_PREPARE, None)
