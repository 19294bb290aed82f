"""Transformers continuous batching (``generate_batch``) on kernel-hub's serving attention.

Continuous batching accepts only ``sdpa``, ``paged|eager`` or a name containing "flash", so the
attention implementation ``kernelize`` gives a model (``kernel_hub_attention``) is rejected by
it. ``kernelize`` therefore also installs, on the model instance, an ``init_continuous_batching``
(what ``generate_batch`` and ``continuous_batching_context_manager`` call) that

1. switches the model's attention to the ragged-attention kernel's flash-named serving function
   and hands the previous implementation to the manager, whose ``stop()`` restores it (as it
   does for its own switches), so outside a batching session the model runs as before;
2. honours ``ContinuousBatchingConfig(max_blocks_per_request=N)``: Transformers 5.24 turns the
   block-table decode path off unless FlashAttention 2/3 runs on CUDA; kernel-hub's paged kernel
   serves it on any device, so the value asked for is put back (unless a layer type, such as
   sliding-window attention, cannot use block tables).

A model with a layer type Transformers' batching cache has no allocator for (Llama 4's chunked
attention; Qwen3-Next's and Qwen3.5's ``linear_attention`` and Mamba layers, which would need a
recurrent and a conv state per request next to the paged KV cache: Transformers 5.24 keeps none)
is left alone with that reason: stock ``generate_batch`` refuses it ("Invalid layer type"), and
so would the switched one.

3. makes the manager of a model whose layers are all full attention build
   ``serving_cache.ServingPagedAttentionCache``: Transformers' layout, but the serving attention
   writes the new K/V into the one buffer by index and reads it without per-layer views (under
   torchax a view is a copy: writes through one are lost, and one in front of a kernel copies
   the whole buffer). Other models keep Transformers' cache (index path only).

An 8-bit KV cache is opt-in: ``generate_batch(model, inputs, kv_cache_dtype="float8_e4m3fn")``
(or "int8"; also ``model.init_continuous_batching(..., kv_cache_dtype=...)`` on a kernelized
model) makes that serving cache 8-bit, which the serving attention quantizes on write and reads
8-bit (the kernels dequantize).

``unkernelize`` removes the instance attribute. Transformers swallows an exception raised in
the batching thread into each result's ``error`` field; ``generate_batch`` here raises it.
Written against Transformers 5.24's continuous batching (it reads the manager's
``_original_attn_impl`` and ``continuous_batching_config``).
"""

from __future__ import annotations

import functools
import logging
import types
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch

from kernel_hub.errors import KernelHubError

from .serving_cache import FULL_ATTENTION, use_serving_cache
from .serving_cache import kv_cache_dtype as _kv_dtype

log = logging.getLogger(__name__)

_ENTRY = "init_continuous_batching"
"""The model method wrapped on the instance."""
_KV_CACHE_DTYPE: ContextVar[str | None] = ContextVar("kernel_hub_kv_cache_dtype", default=None)
"""``generate_batch``'s ``kv_cache_dtype``, for the manager Transformers starts inside it."""


class ContinuousBatchingError(KernelHubError, RuntimeError):
    """A request of ``generate_batch`` failed inside the batching thread."""


def block_tables_supported(config: Any) -> bool:
    """Whether every attention type of the model can use a kernel block table."""
    from transformers.generation.continuous_batching.cache import (
        ATTN_TYPE_TO_ALLOCATOR,
        group_layers_by_attn_type,
    )

    return all(
        ATTN_TYPE_TO_ALLOCATOR[kind].supports_block_table
        for kind in group_layers_by_attn_type(config)
    )


def _allocated_layer_types() -> set[str]:
    from transformers.generation.continuous_batching.cache import ATTN_TYPE_TO_ALLOCATOR

    return set(ATTN_TYPE_TO_ALLOCATOR)


def _layer_types(config: Any) -> set[str]:
    """The attention types of the model's layers, as continuous batching's cache groups them
    (from the text config, as the manager builds the cache)."""
    from transformers.generation.continuous_batching.cache import group_layers_by_attn_type

    return set(group_layers_by_attn_type(config.get_text_config()))


def unbatchable_layer_types(config: Any) -> list[str]:
    """The model's layer types that Transformers' continuous-batching cache cannot hold."""
    configs = (config, config.get_text_config()) if hasattr(config, "get_text_config") else ()
    kinds = {kind for c in configs for kind in getattr(c, "layer_types", None) or ()}
    return sorted(kinds - _allocated_layer_types())


def start_manager(
    model: torch.nn.Module,
    name: str,
    generation_config: Any = None,
    continuous_batching_config: Any = None,
    workload_hints: Any = None,
    kv_cache_dtype: str | None = None,
) -> Any:
    """The stock ``init_continuous_batching`` with the model on attention ``name`` (see the
    module docstring); the manager restores the previous attention when it stops.
    ``kv_cache_dtype`` (default: ``generate_batch``'s) "float8_e4m3fn" or "int8": an 8-bit
    KV cache."""
    if kv_cache_dtype is None:
        kv_cache_dtype = _KV_CACHE_DTYPE.get()
    quantized = None if kv_cache_dtype is None else _kv_dtype(kv_cache_dtype)
    stock = type(model).init_continuous_batching
    requested = getattr(continuous_batching_config, "max_blocks_per_request", None)
    if requested:  # asked for: stock would turn it off (with a warning), it is put back below
        continuous_batching_config.max_blocks_per_request = 0
    previous = model.config._attn_implementation
    model.config._attn_implementation = name
    try:
        manager = stock(
            model,
            generation_config=generation_config,
            continuous_batching_config=continuous_batching_config,
            workload_hints=workload_hints,
        )
    except BaseException:
        model.config._attn_implementation = previous
        raise
    if manager._original_attn_impl is None and previous != name:
        manager._original_attn_impl = previous
    if quantized is not None or _layer_types(model.config) == {FULL_ATTENTION}:
        use_serving_cache(manager, quantized)
    if requested:
        if block_tables_supported(model.config):
            manager.continuous_batching_config.max_blocks_per_request = requested
        else:
            log.warning(
                "max_blocks_per_request=%s: the decode block-table path stays off, a layer type "
                "of %s (e.g. sliding-window attention) has no block tables",
                requested,
                type(model).__name__,
            )
    return manager


@dataclass(frozen=True)
class ContinuousBatchingInterface:
    """kernelize's switch for continuous batching, shaped like its ``ModelInterface``s: the
    op's ``integrations.register()`` names the serving function; ``switch`` installs the entry
    point, ``restore`` removes it."""

    attention: Any
    """The attention ``ModelInterface``: which modules dispatch, and the current names."""
    name: str = "ContinuousBatching"
    kind: str = "continuous batching"
    op: str = "ragged-attention"

    def dispatches(self, module: torch.nn.Module) -> bool:
        return self.attention.dispatches(module)

    def unreached(self, model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, str]]:
        """Modules seen but not switchable: as for the attention interface it rides on."""
        return self.attention.unreached(model)

    def integration(self, kernel: types.ModuleType) -> Any:
        """The serving op's ``integrations`` module, whose ``register()`` names the function."""
        return self.attention.integration(kernel)

    def model_problem(self, model: torch.nn.Module, modules: list) -> str | None:
        if not callable(getattr(type(model), _ENTRY, None)):
            return (
                f"{type(model).__name__} has no {_ENTRY}(); continuous batching needs a "
                "Transformers generation model"
            )
        unbatchable = unbatchable_layer_types(getattr(model, "config", None))
        if unbatchable:
            return (
                f"Transformers' continuous-batching cache holds no {', '.join(unbatchable)} "
                f"layers (only {', '.join(sorted(_allocated_layer_types()))}; linear-attention "
                "and Mamba layers would need a recurrent and a conv state per request next to "
                "the paged KV cache); generate_batch refuses the model"
            )
        return None

    def current(self, model: torch.nn.Module) -> dict[str, Any]:
        """{"": the serving attention name kernel-hub's entry point switches to, or None}."""
        return {"": serving_attention(model)}

    def switch(self, model: torch.nn.Module, name: Any) -> str:
        problem = self.attention.registered(name) if isinstance(name, str) else "is not a name"
        if problem or "flash" not in name:
            raise KernelHubError(
                f"integrations.register() returned {name!r}, which continuous batching cannot "
                f"use: {problem or 'the name must contain flash'}"
            )
        entry = functools.partial(start_manager, model, name)
        functools.update_wrapper(entry, type(model).init_continuous_batching)
        model.__dict__[_ENTRY] = entry
        return name

    def restore(self, model: torch.nn.Module, previous: dict[str, Any]) -> None:
        model.__dict__.pop(_ENTRY, None)


def serving_attention(model: torch.nn.Module) -> str | None:
    """The attention name kernelize's ``init_continuous_batching`` switches ``model`` to for a
    batching session; None when kernelize installed none."""
    entry = model.__dict__.get(_ENTRY)
    return entry.args[1] if isinstance(entry, functools.partial) else None


def generate_batch(
    model: torch.nn.Module,
    inputs: list[list[int]],
    *,
    kv_cache_dtype: str | None = None,
    **kwargs: Any,
) -> dict:
    """``model.generate_batch(inputs, **kwargs)``, raising ``ContinuousBatchingError`` when a
    request failed (Transformers returns such requests with an ``error`` and no tokens).

    ``kv_cache_dtype`` "float8_e4m3fn" or "int8" (opt-in, lossy): the batch's KV cache holds
    8-bit keys and values with one f32 scale per token and kv head (see ``serving_cache``);
    the model must be kernelized (kernel-hub's serving attention reads that cache)."""
    if kv_cache_dtype is not None:
        _kv_dtype(kv_cache_dtype)
        if serving_attention(model) is None:
            raise KernelHubError(
                f"kv_cache_dtype={kv_cache_dtype!r} needs a kernelized model: only kernel-hub's "
                "serving attention reads an 8-bit KV cache (kernelize(model) first)"
            )
    token = _KV_CACHE_DTYPE.set(kv_cache_dtype)
    try:
        results = model.generate_batch(inputs, **kwargs)
    finally:
        _KV_CACHE_DTYPE.reset(token)
    failed = {rid: out.error for rid, out in results.items() if out.error is not None}
    if failed:
        listing = "; ".join(f"{rid}: {error}" for rid, error in sorted(failed.items()))
        raise ContinuousBatchingError(
            f"{len(failed)} of {len(results)} requests failed in the batching thread: {listing}"
        )
    missing = len(inputs) - len(results)
    if missing > 0:
        raise ContinuousBatchingError(f"{missing} requests returned no result")
    return results
