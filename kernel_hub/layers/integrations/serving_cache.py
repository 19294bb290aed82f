"""kernel-hub's paged KV cache for Transformers' continuous batching: one buffer, written by index.

``ServingPagedAttentionCache`` is Transformers 5.24's ``PagedAttentionCache`` (same allocator,
same layout: one flat buffer whose pages alternate layer 0 keys, layer 0 values, layer 1 keys,
...) whose ``update`` writes nothing. It hands kernel-hub's serving attention (the
ragged-attention kernel's serving function) the whole buffer as pages, ``kv_pages`` [P, page,
Hkv, D], and the layer's page offsets ``kv_page_offsets`` (2i for its keys, 2i + 1 for its
values, i its place in the allocator), plus this layer group's ``block_table`` (block-table
decode) or ``kv_write_index``/``kv_read_index`` (index path; token indices of the layer's keys,
as Transformers gives them). The attention function writes the new K/V into the buffer with an
index (token ``t`` of the layer's keys is row ``t % page`` of page ``t // page + 2i``) and
reads it back. No per-layer view of the buffer is made: under torchax (TorchTPU's tracing)
``Tensor.view`` returns a copy, so a write through a view never reached the cache and a view in
front of a kernel became a copy of the whole buffer.

With ``kv_cache_dtype`` "float8_e4m3fn" or "int8" (opt-in, lossy) the pages are 8-bit (one byte
an element) and one f32 scale page buffer mirrors them, ``kv_scale_pages`` [P, Hkv, page] (page
``p``'s scales at row ``p``); the serving attention quantizes on write (``kv_quant``) and the
kernels dequantize. The scales cost 4 bytes per token and kv head beyond ``num_blocks``' budget.

Only that attention function can serve a batch on this cache, so ``start_manager`` installs it
only together with kernel-hub's serving attention. Limits: models whose every layer is full
attention (sliding-window and other layer types keep Transformers' own cache); an 8-bit cache
cannot fork a request (``num_return_sequences > 1``: Transformers copies K/V bytes, not the
scales). With an 8-bit cache Transformers sizes the cache and the batch from the cache dtype's
itemsize, which it also takes as the activations' (1 byte): pass ``num_blocks`` and
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
FULL_ATTENTION = "full_attention"
"""The one layer type this cache serves."""


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
def serving_cache_class() -> type:
    """``ServingPagedAttentionCache`` (defined on first use: it subclasses a Transformers
    class, which kernel-hub imports only when a model needs it)."""
    return _define(_base())


def _define(base: type) -> type:
    class ServingPagedAttentionCache(base):
        """``PagedAttentionCache`` handing the whole buffer and the layer's page offsets to
        kernel-hub's serving attention; 8-bit with f32 scale pages when ``kv_cache_dtype`` is."""

        def __init__(
            self,
            config: Any,
            continuous_batching_config: Any,
            device: torch.device | str,
            distributed_helper: Any,
            dtype: torch.dtype = torch.float16,
            model_supports_logits_to_keep: bool = False,
            *,
            kv_cache_dtype: torch.dtype | None = None,
        ) -> None:
            super().__init__(
                config,
                continuous_batching_config,
                device,
                distributed_helper,
                dtype=dtype if kv_cache_dtype is None else kv_cache_dtype,
                model_supports_logits_to_keep=model_supports_logits_to_keep,
            )
            self.activation_dtype = dtype
            kinds = sorted(self.cache_allocators)
            if kinds != [FULL_ATTENTION]:
                raise KernelHubError(
                    f"kernel-hub's serving cache holds models whose layers are all full "
                    f"attention; this one has {', '.join(kinds)} layers"
                )
            allocator = self.cache_allocators[FULL_ATTENTION]
            page = allocator.tokens_per_page
            self.kv_pages = allocator.cache_tensor.view(
                -1, page, allocator.num_key_value_heads, allocator.head_dim
            )
            """Every page of the buffer, keys and values of every layer (a traced step may
            rebind it to its own argument)."""
            self.kv_page_offsets = {
                layer: (2 * i, 2 * i + 1) for i, layer in enumerate(allocator.layer_indices)
            }
            self.kv_scale_pages = None
            if kv_cache_dtype is not None:
                self.kv_scale_pages = torch.ones(
                    self.kv_pages.shape[0],
                    allocator.num_key_value_heads,
                    page,
                    dtype=torch.float32,
                    device=device,
                )

        def update(
            self,
            key_states: torch.Tensor,
            value_states: torch.Tensor,
            layer_idx: int,
            kwargs: dict[str, Any],
        ) -> tuple[torch.Tensor, torch.Tensor]:
            """Select this layer's batch arguments as the stock update does and hand the buffer
            to the attention function, which writes and reads it (nothing written here)."""
            allocator = self.layer_to_allocator[layer_idx]
            kwargs["cu_seq_lens_k"] = kwargs["cu_seq_lens_k"][allocator.layer_type].to(torch.int32)
            kwargs["max_length_k"] = kwargs["max_length_k"][allocator.layer_type]
            kwargs["kv_pages"] = self.kv_pages
            kwargs["kv_page_offsets"] = self.kv_page_offsets[layer_idx]
            kwargs["kv_scale_pages"] = self.kv_scale_pages
            block_table = kwargs.get("block_table")
            if block_table is not None:
                kwargs["block_table"] = block_table[allocator.index]
            else:
                kwargs["kv_write_index"] = kwargs["write_index"][allocator.index]
                kwargs["kv_read_index"] = kwargs["read_index"][allocator.index]
            return key_states, value_states

        def prepare_fork_request(self, *args: Any, **kwargs: Any) -> list[str]:
            if self.kv_scale_pages is not None:
                raise KernelHubError(
                    "an 8-bit KV cache cannot fork a request (num_return_sequences > 1): "
                    "Transformers copies the cache's K/V bytes but not their scales"
                )
            return super().prepare_fork_request(*args, **kwargs)

    return ServingPagedAttentionCache


def use_serving_cache(manager: Any, dtype: torch.dtype | None = None) -> None:
    """Make ``manager`` (a ``ContinuousBatchingManager``, not yet started) build its cache as a
    ``ServingPagedAttentionCache`` (8-bit in ``dtype`` when given): its
    ``_create_batch_processor`` runs as Transformers wrote it, on this instance only, with the
    cache class it names swapped."""
    if getattr(manager, "batch_processor", None) is not None:
        raise KernelHubError(
            "this continuous-batching manager (a persistent one) already built its cache; call "
            "model.destroy_cached_continuous_batching_manager() first"
        )
    stock = type(manager)._create_batch_processor
    name = _base().__name__
    if name not in stock.__code__.co_names:
        raise KernelHubError(
            f"this Transformers' ContinuousBatchingManager builds no {name}; kernel-hub's "
            "serving cache is written against Transformers 5.24"
        )

    def build(*args: Any, **kwargs: Any) -> Any:
        return serving_cache_class()(*args, kv_cache_dtype=dtype, **kwargs)

    scope = dict(stock.__globals__, **{name: build})
    method = types.FunctionType(
        stock.__code__, scope, stock.__name__, stock.__defaults__, stock.__closure__
    )
    manager._create_batch_processor = types.MethodType(method, manager)
