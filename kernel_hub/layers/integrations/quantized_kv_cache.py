"""An 8-bit KV cache for Transformers' continuous batching: storage, not arithmetic.

``QuantizedPagedAttentionCache`` is Transformers 5.24's ``PagedAttentionCache`` with its pages
held in float8_e4m3fn or int8 (the same layout, one byte an element) plus one f32 scale page
buffer mirroring it: [view pages, Hkv, page], shifted per layer by the same whole pages as the
K/V views, so a block-table page id (or a token index // page) names a page of K/V and of its
scales alike. The scales cost 4 bytes per token and kv head beyond ``num_blocks``' budget.

Its ``update`` writes nothing: it hands the layer's 8-bit views and scale pages to the attention
function (``k_cache``/``v_cache``, ``k_scale_cache``/``v_scale_cache``; on the index path also
this layer group's ``kv_write_index``/``kv_read_index``), which quantizes on write and reads the
cache (the ragged-attention kernel's serving function; its ``kv_quant`` defines the format).
Only that function can serve a batch on this cache, so ``start_manager`` installs it only
together with kernel-hub's serving attention.

Limits: models whose every layer is full attention (sliding-window and other layer types keep
Transformers' own cache layout); no cache fork (``num_return_sequences > 1``: Transformers
copies K/V bytes, not the scales). Transformers sizes the cache and the batch from the cache
dtype's itemsize, which it also takes as the activations' (1 byte): pass ``num_blocks`` and
``max_batch_tokens`` explicitly.
"""

from __future__ import annotations

import functools
import types
from typing import Any

import torch

from kernel_hub.errors import KernelHubError

KV_CACHE_DTYPES = {"float8_e4m3fn": torch.float8_e4m3fn, "int8": torch.int8}
"""The 8-bit cache dtypes by name (the ragged-attention kernel's ``kv_quant.KV_CACHE_DTYPES``)."""
_FULL_ATTENTION = "full_attention"


def kv_cache_dtype(name: str | torch.dtype) -> torch.dtype:
    """The torch dtype of the 8-bit cache ``name``; anything else is refused, naming the valid."""
    dtype = KV_CACHE_DTYPES.get(str(name).removeprefix("torch."))
    if dtype is None:
        raise KernelHubError(
            f"kv_cache_dtype={name!r} is not supported; valid: {', '.join(KV_CACHE_DTYPES)} "
            "(or None: the cache in the model's dtype)"
        )
    return dtype


def _base() -> type:
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    return PagedAttentionCache


@functools.cache
def quantized_cache_class() -> type:
    """``QuantizedPagedAttentionCache`` (defined on first use: it subclasses a Transformers
    class, which kernel-hub imports only when a model needs it)."""
    return _define(_base())


def _define(base: type) -> type:
    class QuantizedPagedAttentionCache(base):
        """``PagedAttentionCache`` in an 8-bit ``kv_cache_dtype`` with f32 scale pages."""

        def __init__(
            self,
            config: Any,
            continuous_batching_config: Any,
            device: torch.device | str,
            distributed_helper: Any,
            dtype: torch.dtype = torch.float16,
            model_supports_logits_to_keep: bool = False,
            *,
            kv_cache_dtype: torch.dtype,
        ) -> None:
            super().__init__(
                config,
                continuous_batching_config,
                device,
                distributed_helper,
                dtype=kv_cache_dtype,
                model_supports_logits_to_keep=model_supports_logits_to_keep,
            )
            self.activation_dtype = dtype
            kinds = sorted(self.cache_allocators)
            if kinds != [_FULL_ATTENTION]:
                raise KernelHubError(
                    f"an 8-bit KV cache serves models whose layers are all full attention; this "
                    f"one has {', '.join(kinds)} layers"
                )
            allocator = self.cache_allocators[_FULL_ATTENTION]
            page = allocator.tokens_per_page
            rows = allocator.cache_tensor.shape[0] * 2  # keys and values of every token slot
            buffer = torch.ones(
                rows // page,
                allocator.num_key_value_heads,
                page,
                dtype=torch.float32,
                device=device,
            )
            self.scale_pages: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
            for i, layer in enumerate(allocator.layer_indices):
                pages = buffer.shape[0] - 2 * i - 1  # as the K/V page views: V's count
                self.scale_pages[layer] = (
                    buffer[2 * i : 2 * i + pages],
                    buffer[2 * i + 1 : 2 * i + 1 + pages],
                )

        def update(
            self,
            key_states: torch.Tensor,
            value_states: torch.Tensor,
            layer_idx: int,
            kwargs: dict[str, Any],
        ) -> tuple[torch.Tensor, torch.Tensor]:
            """Select this layer's batch arguments as the stock update does, and hand the 8-bit
            views to the attention function, which writes and reads them (nothing written here)."""
            allocator = self.layer_to_allocator[layer_idx]
            kwargs["cu_seq_lens_k"] = kwargs["cu_seq_lens_k"][allocator.layer_type].to(torch.int32)
            kwargs["max_length_k"] = kwargs["max_length_k"][allocator.layer_type]
            kwargs["k_scale_cache"], kwargs["v_scale_cache"] = self.scale_pages[layer_idx]
            block_table = kwargs.get("block_table")
            if block_table is not None:
                kwargs["block_table"] = block_table[allocator.index]
                views = allocator.get_cache_for_block_table(layer_idx)
            else:
                views = allocator._kv_token_views[layer_idx]
                kwargs["kv_write_index"] = kwargs["write_index"][allocator.index]
                kwargs["kv_read_index"] = kwargs["read_index"][allocator.index]
            kwargs["k_cache"], kwargs["v_cache"] = views
            return key_states, value_states

        def prepare_fork_request(self, *args: Any, **kwargs: Any) -> list[str]:
            raise KernelHubError(
                "an 8-bit KV cache cannot fork a request (num_return_sequences > 1): "
                "Transformers copies the cache's K/V bytes but not their scales"
            )

    return QuantizedPagedAttentionCache


def use_quantized_cache(manager: Any, dtype: torch.dtype) -> None:
    """Make ``manager`` (a ``ContinuousBatchingManager``, not yet started) build its cache as a
    ``QuantizedPagedAttentionCache`` in ``dtype``: its ``_create_batch_processor`` runs as
    Transformers wrote it, on this instance only, with the cache class it names swapped."""
    if getattr(manager, "batch_processor", None) is not None:
        raise KernelHubError(
            "kv_cache_dtype: this continuous-batching manager (a persistent one) already built "
            "its cache; call model.destroy_cached_continuous_batching_manager() first"
        )
    stock = type(manager)._create_batch_processor
    name = _base().__name__
    if name not in stock.__code__.co_names:
        raise KernelHubError(
            f"this Transformers' ContinuousBatchingManager builds no {name}; kernel-hub's 8-bit "
            "KV cache is written against Transformers 5.24"
        )

    def build(*args: Any, **kwargs: Any) -> Any:
        return quantized_cache_class()(*args, kv_cache_dtype=dtype, **kwargs)

    scope = dict(stock.__globals__, **{name: build})
    method = types.FunctionType(
        stock.__code__, scope, stock.__name__, stock.__defaults__, stock.__closure__
    )
    manager._create_batch_processor = types.MethodType(method, manager)
