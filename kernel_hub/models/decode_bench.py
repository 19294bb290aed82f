"""One decode step for ``kernel-hub model-bench --mode decode``: a new token for each of B
sequences over a KV cache holding C tokens per sequence (the new one included), in the cache the
model would use.

* ``static``: Transformers' ``StaticCache`` (``generate`` with ``cache_implementation="static"``),
  ``[B, Hkv, C, D]`` keys and values per layer. Stock attention is SDPA over the whole cache under
  the causal mask; kernelized attention gets the mask as a description (key positions) and runs the
  flash kernel. A linear-attention layer (Qwen3-Next's gated delta net) holds a
  ``LinearAttentionLayer`` instead: its conv state ``[B, channels, width]`` and f32 recurrent
  state ``[B, value heads, key dim, value dim]`` as after a prefill, which the step updates in
  place (stock: Transformers' torch fallbacks; kernelized: ``causal_conv1d_update`` and
  ``recurrent_gated_delta_rule``).
* ``paged``: Transformers' continuous-batching ``PagedAttentionCache`` (what ``generate_batch``
  runs), one flat buffer of pages. Stock continuous batching on a TPU takes the index path: the
  new K/V written at ``write_index``, every sequence's history gathered at ``read_index`` into one
  packed row, SDPA with CB's additive mask ``[1, 1, B, B*C + B]``; torchax's ``Tensor.view``
  returns a copy, so Transformers' write through its per-layer views never reaches the buffer
  (stock's behaviour under torchax: its program holds no cache write). Kernelized, the
  block-table decode path on kernel-hub's serving cache (what ``generate_batch`` on a kernelized
  model builds): the serving attention writes the new K/V into the buffer by index, gathers the
  pages the block table names and runs the paged kernel on them; no per-layer copy of the buffer.

An 8-bit cache (``kv_cache_dtype`` "float8_e4m3fn" or "int8", kernelized only): kernel-hub's
serving caches in that dtype, pages of one byte an element beside f32 scale pages (one scale per
token and kv head), which the serving attention quantizes on write and the paged kernel
dequantizes on read; pages and scales are the traced cache argument. ``paged``: the serving
paged cache above, 8-bit. ``static``: ``static_kv_cache``'s ``ServingStaticCache`` (a static
cache in page form, each sequence owning its pages; the paged kernel reads them in place).

The cache is an argument of the traced step and donated: the step returns it updated, as the
serving loop reuses it. ``min_bytes_correction`` makes the hand count of least traffic the
weights read once + the live KV (B x C tokens, with their scales when 8-bit) read once + the new
tokens' K/V written + linear-attention states read and written once + the logits: the cache
buffer's unused room (a paged cache's spare pages) is not counted.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from kernel_hub.errors import KernelInputError

CACHES = ("static", "paged")
KV_CACHE_DTYPES = ("bfloat16", "float8_e4m3fn", "int8")
"""The decode cache's element dtype: the model's bf16, or the serving cache's 8-bit formats."""
SCALE_BYTES = 4
"""An 8-bit cache's f32 scale per token and kv head."""
PAGE_SIZE = 256
"""Tokens per page of the paged cache (continuous batching's default)."""


@dataclass(frozen=True)
class DecodeShape:
    """Batch, context (tokens per sequence in the cache after this step), the cache kind and
    its element dtype (``KV_CACHE_DTYPES``)."""

    batch: int
    context: int
    cache: str
    kv_cache_dtype: str = "bfloat16"

    @property
    def quantized(self) -> bool:
        return self.kv_cache_dtype != "bfloat16"


@dataclass(frozen=True)
class DecodeStep:
    """A traced-ready decode step: ``function(params, buffers, cache, *inputs)`` returns
    ``(logits, cache)``; ``inputs`` are abstract (shape and dtype) like the rest."""

    function: Callable[..., Any]
    cache: Any
    inputs: tuple[Any, ...]
    min_bytes_correction: float
    """Added to arguments + outputs - aliased outputs to give the hand count (see module doc)."""


def _kv_geometry(config: Any) -> tuple[int, int, int]:
    """(decoder layers, KV heads, head dim) of a Transformers config."""
    text = config.get_text_config(decoder=True)
    heads = text.num_key_value_heads or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return text.num_hidden_layers, heads, head_dim


def _tree_bytes(tree: Any) -> int:
    """Bytes of every (abstract) array in ``tree``."""
    import jax

    return sum(math.prod(leaf.shape) * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))


def _token_kv_bytes(
    config: Any, kv_cache_dtype: str = "bfloat16", layers: int | None = None
) -> int:
    """Bytes of one token's keys and values over every layer (or ``layers`` of them): bf16, or
    8-bit with one f32 scale per kv head."""
    every, heads, head_dim = _kv_geometry(config)
    layers = every if layers is None else layers
    if kv_cache_dtype == "bfloat16":
        return 2 * layers * heads * head_dim * 2
    return 2 * layers * heads * (head_dim + SCALE_BYTES)


def decode_step(model: Any, shape: DecodeShape, abstract: Callable[..., Any]) -> DecodeStep:
    """The step for ``shape.cache``; ``abstract(shape, dtype)`` makes an abstract argument
    (``abstract(shape, dtype, heads_dim=1)`` a static cache's ``[B, Hkv, C, D]`` tensor, whose
    heads a sharded step splits)."""
    build = {"static": _static_step, "paged": _paged_step}[shape.cache]
    if shape.quantized and shape.cache == "static":
        build = _static_8bit_step
    return build(model, shape, abstract)


STATE_MIXERS = ("Qwen3NextGatedDeltaNet", "Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet")
"""The linear-attention mixers whose decode states model-bench binds: Qwen3-Next's gated delta net
and Qwen3.5's copies of it (one conv state and one f32 recurrent state a layer)."""


def _linear_states(model: Any, index: int, batch: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of linear-attention layer ``index``'s conv state ``[B, channels, width]`` (model
    dtype) and recurrent state ``[B, value heads, key dim, value dim]`` (f32), as the stock mixer
    initialises them in prefill; any other mixer is refused (its states may differ in number,
    layout or dtype)."""
    for module in model.modules():
        names = {kind.__name__ for kind in type(module).__mro__}
        if getattr(module, "layer_idx", None) == index and names & set(STATE_MIXERS):
            conv = (batch, module.conv_dim, module.conv_kernel_size)
            return conv, (batch, module.num_v_heads, module.head_k_dim, module.head_v_dim)
    raise KernelInputError(
        f"--cache static: layer {index} is a linear-attention layer whose mixer is not one "
        f"model-bench binds the states of ({', '.join(STATE_MIXERS)}); not built"
    )


@contextlib.contextmanager
def _copy_from_views(env: Any) -> Iterator[None]:
    """torchax's ``copy_`` into a tensor reads the source's array directly, which a view (a slice)
    does not have (AttributeError): Transformers' conv-state update copies a slice into the
    state. In this block a view source is materialised first (the same values)."""
    import dataclasses

    import torch
    from torchax.view import View

    key = torch.ops.aten.copy_
    stock = env._ops[key]

    def copy(x: Any, y: Any, *args: Any, **kwargs: Any) -> Any:
        return stock.func(x, y.torch() if isinstance(y, View) else y, *args, **kwargs)

    env._ops[key] = dataclasses.replace(stock, func=copy)
    try:
        yield
    finally:
        env._ops[key] = stock


def _static_step(model: Any, shape: DecodeShape, abstract: Callable[..., Any]) -> DecodeStep:
    import jax.numpy as jnp
    import torch
    import torchax
    from torchax.ops.mappings import t2j_dtype
    from transformers import StaticCache
    from transformers.cache_utils import CacheLayerMixin, LinearAttentionCacheLayerMixin

    env = torchax.default_env()
    batch, context = shape.batch, shape.context
    _, heads, head_dim = _kv_geometry(model.config)
    layers = StaticCache(model.config, context).layers
    attention = [i for i, layer in enumerate(layers) if isinstance(layer, CacheLayerMixin)]
    linear = [
        i for i, layer in enumerate(layers) if isinstance(layer, LinearAttentionCacheLayerMixin)
    ]
    if set(attention) & set(linear) or len(attention) + len(linear) != len(layers):
        raise KernelInputError(
            "--cache static: a layer that holds both K/V and linear-attention states, or "
            "neither, is not bound by model-bench"
        )
    # A sliding-window layer keeps min(window, C) tokens; a full one C.
    kv = [
        abstract((batch, heads, layers[i].max_cache_len, head_dim), jnp.bfloat16, heads_dim=1)
        for i in attention
    ]
    states = [_linear_states(model, i, batch) for i in linear]
    conv_dtype = t2j_dtype(next(model.parameters()).dtype)
    cache = {
        "keys": kv,
        "values": kv,
        "conv_states": [abstract(conv, conv_dtype) for conv, _ in states],
        "recurrent_states": [abstract(recurrent, jnp.float32) for _, recurrent in states],
    }
    inputs = (abstract((batch, 1), jnp.int32), abstract((), jnp.int32))

    def forward(params: Any, buffers: Any, kv_cache: Any, ids: Any, past: Any) -> Any:
        t_params, t_buffers, t_cache, t_ids, t_past = env.j2t_iso(
            (params, buffers, kv_cache, ids, past)
        )
        with env, _copy_from_views(env):
            static = StaticCache(config=model.config, max_cache_len=context)
            for i, keys, values in zip(attention, t_cache["keys"], t_cache["values"], strict=True):
                layer = static.layers[i]
                layer.keys, layer.values = keys, values
                layer.device, layer.batch_size, layer.num_heads = keys.device, batch, heads
                layer.k_head_dim = layer.v_head_dim = head_dim
                layer.cumulative_length = t_past.clone()
                if hasattr(layer, "cumulative_length_int"):  # sliding: its ring is full or not
                    layer.cumulative_length_int = context - 1
                layer.is_initialized = True
            for i, conv, recurrent in zip(
                linear, t_cache["conv_states"], t_cache["recurrent_states"], strict=True
            ):
                # after a prefill: both states held, updated in place (copy_) by the step
                layer = static.layers[i]
                layer.conv_states[0], layer.recurrent_states[0] = conv, recurrent
                layer.conv_kernel_size[0] = conv.shape[-1]
                layer.device, layer.dtype = conv.device, conv.dtype
                layer.is_conv_states_initialized[0] = True
                layer.is_recurrent_states_initialized[0] = True
                layer.has_previous_state[0] = True
            out = torch.func.functional_call(
                model, {**t_params, **t_buffers}, (t_ids,), {"cache": static, "use_cache": True}
            )
            updated = {
                "keys": [static.layers[i].keys for i in attention],
                "values": [static.layers[i].values for i in attention],
                "conv_states": [static.layers[i].conv_states[0] for i in linear],
                "recurrent_states": [static.layers[i].recurrent_states[0] for i in linear],
            }
            return env.t2j_iso((out.logits, updated))

    # The whole buffer is live (C tokens a sequence in a full layer, min(window, C) in a sliding
    # one) and read once; the new token's K/V is written in each attention layer; a linear layer's
    # states are read once (arguments) and rewritten whole (aliased outputs, so added here).
    new_kv = batch * _token_kv_bytes(model.config, layers=len(attention))
    written = cache["conv_states"] + cache["recurrent_states"]
    state_bytes = _tree_bytes(written)
    return DecodeStep(forward, cache, inputs, new_kv + state_bytes)


def _serving_attention(model: Any, shape: DecodeShape) -> str:
    """The serving attention kernelize installed, which alone reads an 8-bit cache."""
    from kernel_hub.layers.integrations.continuous_batching import serving_attention

    serving = serving_attention(model)
    if serving is None:
        raise KernelInputError(
            f"kv_cache_dtype {shape.kv_cache_dtype}: only kernel-hub's serving attention reads "
            "an 8-bit cache, and kernelize installed none on this model (see its report)"
        )
    return serving


def _on_attention(model: Any, name: str, forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` run with the model's attention implementation switched to ``name``."""

    def function(*args: Any) -> Any:
        previous = model.config._attn_implementation
        model.config._attn_implementation = name
        try:
            return forward(*args)
        finally:
            model.config._attn_implementation = previous

    return function


def _static_8bit_step(model: Any, shape: DecodeShape, abstract: Callable[..., Any]) -> DecodeStep:
    """The static cache 8-bit: ``static_kv_cache``'s ``ServingStaticCache``, its layers' pages
    and scale pages bound to the traced cache, on the serving attention (as inside a
    ``static_kv_cache`` block)."""
    import jax.numpy as jnp
    import torch
    import torchax

    from kernel_hub.layers.integrations.static_kv_cache import static_cache_class

    env = torchax.default_env()
    serving = _serving_attention(model, shape)
    batch, context = shape.batch, shape.context
    _, heads, head_dim = _kv_geometry(model.config)
    build = static_cache_class()
    layers = build(model.config, context, kv_cache_dtype=shape.kv_cache_dtype).layers
    pages = batch * layers[0].pages_per_sequence
    page = layers[0].page
    kv = abstract((pages, page, heads, head_dim), getattr(jnp, shape.kv_cache_dtype))
    scales = abstract((pages, heads, page), jnp.float32)
    cache = {
        name: [part] * len(layers)
        for name, part in (("keys", kv), ("values", kv), ("k_scales", scales), ("v_scales", scales))
    }
    inputs = (abstract((batch, 1), jnp.int32), abstract((), jnp.int32))

    def forward(params: Any, buffers: Any, kv_cache: Any, ids: Any, past: Any) -> Any:
        t_params, t_buffers, t_cache, t_ids, t_past = env.j2t_iso(
            (params, buffers, kv_cache, ids, past)
        )
        with env:
            static = build(model.config, context, kv_cache_dtype=shape.kv_cache_dtype)
            for i, layer in enumerate(static.layers):
                layer.k_pages, layer.v_pages = t_cache["keys"][i], t_cache["values"][i]
                layer.k_scale_pages = t_cache["k_scales"][i]
                layer.v_scale_pages = t_cache["v_scales"][i]
                layer.keys, layer.values = layer.k_pages, layer.v_pages
                layer.device, layer.batch_size, layer.num_heads = t_ids.device, batch, heads
                layer.k_head_dim = layer.v_head_dim = head_dim
                layer.cumulative_length = t_past.clone()
                layer.length = context - 1  # the new token makes C
                layer.is_initialized = True
            out = torch.func.functional_call(
                model, {**t_params, **t_buffers}, (t_ids,), {"cache": static, "use_cache": True}
            )
            return env.t2j_iso((out.logits, t_cache))

    # Live: B x C tokens a layer (read once), the B new ones written; a last page's spare rows
    # are not traffic.
    token = _token_kv_bytes(model.config, shape.kv_cache_dtype)
    buffer_bytes = _tree_bytes(cache)
    correction = batch * context * token + batch * token - buffer_bytes
    return DecodeStep(_on_attention(model, serving, forward), cache, inputs, correction)


@contextlib.contextmanager
def _sized_as_given() -> Iterator[None]:
    """Inside, a continuous-batching cache is sized by the ``num_blocks`` given alone:
    Transformers checks its footprint against its device's free memory, here this host's (the
    cache is on the meta device and allocates nothing; whether the step fits the TPU's HBM is
    libtpu's check when it compiles). Its memory handler is swapped for one that sees no limit,
    in this block only."""
    from transformers.generation.continuous_batching import cache as module

    stock = module.PagedAttentionMemoryHandler

    class Unbounded(stock):
        def get_available_memory(self) -> int:
            return sys.maxsize

    module.PagedAttentionMemoryHandler = Unbounded
    try:
        yield
    finally:
        module.PagedAttentionMemoryHandler = stock


def _paged_cache(config: Any, shape: DecodeShape, serving: bool) -> Any:
    """Continuous batching's cache on the meta device, sized to hold B x C tokens: Transformers'
    own, or kernel-hub's serving cache (``serving``, 8-bit when ``shape`` says); its buffer is
    replaced by the traced argument (``_bind``)."""
    import torch
    from transformers import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.cache import PagedAttentionCache
    from transformers.generation.continuous_batching.distributed import DistributedHelper

    from kernel_hub.layers.integrations.serving_cache import serving_cache_class

    pages = -(-shape.context // PAGE_SIZE)
    settings = ContinuousBatchingConfig(
        page_size=PAGE_SIZE,
        num_blocks=shape.batch * pages,
        max_batch_tokens=shape.batch,
        max_blocks_per_request=pages,
    )
    options = {}
    if shape.quantized:
        options["kv_cache_dtype"] = getattr(torch, shape.kv_cache_dtype)
    kind = serving_cache_class() if serving else PagedAttentionCache
    with _sized_as_given():
        return kind(
            config,
            settings,
            device="meta",
            distributed_helper=DistributedHelper(None, None),
            dtype=torch.bfloat16,
            **options,
        )


class _BytesView:
    """The traced bf16 cache buffer where ``register_cache_tensor`` expects continuous
    batching's uint8 one (torchax has no dtype-reinterpreting view): its view as the cache dtype
    is the buffer itself; the byte rows it keeps for forking requests are not used by a step."""

    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor

    def view(self, *shape: Any) -> Any:
        return self.tensor if shape == (self.tensor.dtype,) else None


def _bind(cache: Any, buffer: Any) -> None:
    """Point ``cache`` at ``buffer`` (the traced cache): a serving cache reads and writes its
    pages, ``buffer`` itself (8-bit: ``{"pages", "scales"}``); Transformers' cache (bf16),
    every allocator through its own layout code."""
    if isinstance(buffer, dict):
        cache.kv_pages, cache.kv_scale_pages = buffer["pages"], buffer["scales"]
        return
    if hasattr(cache, "kv_pages"):
        cache.kv_pages = buffer
        return
    non_trash = cache.num_sectors * cache.bytes_per_sector
    for allocator in cache.cache_allocators.values():
        allocator.register_cache_tensor(
            cache.bytes_per_sector, non_trash, _BytesView(buffer), cache.pool
        )


def _paged_step(model: Any, shape: DecodeShape, abstract: Callable[..., Any]) -> DecodeStep:
    import jax.numpy as jnp
    import torch
    import torchax

    from kernel_hub.layers.integrations.continuous_batching import serving_attention

    env = torchax.default_env()
    batch, context = shape.batch, shape.context
    # Kernelized: kernelize's continuous-batching entry point switches the model to the serving
    # attention, which takes the block-table path on kernel-hub's serving cache. Stock continuous
    # batching on a TPU runs SDPA on the index path (Transformers keeps block tables for
    # FlashAttention on CUDA).
    serving = _serving_attention(model, shape) if shape.quantized else serving_attention(model)
    block_table = serving is not None
    paged = _paged_cache(model.config, shape, block_table)
    kinds = list(paged.cache_allocators)
    if kinds != ["full_attention"]:
        raise KernelInputError(
            f"--cache paged: model-bench builds the paged decode step for full-attention layers "
            f"only; this model's continuous-batching cache has {', '.join(kinds)} groups (a "
            "sliding-window ring takes no block table); use --cache static"
        )
    groups = len(kinds)
    if block_table:  # the serving cache's pages: the buffer itself, written by index
        buffer = abstract(tuple(paged.kv_pages.shape), getattr(jnp, shape.kv_cache_dtype))
        if shape.quantized:
            scales = abstract(tuple(paged.kv_scale_pages.shape), jnp.float32)
            buffer = {"pages": buffer, "scales": scales}
    else:
        buffer = abstract((paged.cache_tensor.numel() // 2,), jnp.bfloat16)
    ids = abstract((1, batch), jnp.int32)
    lengths = abstract((batch + 1,), jnp.int32)  # cu_seq_lens_q, then cu_seq_lens_k
    if block_table:
        tables = abstract((groups, batch, paged.max_blocks_per_request), jnp.int32)
        inputs = (ids, ids, lengths, lengths, abstract((groups, batch), jnp.int32), tables)
    else:
        reads = abstract((groups, batch * context), jnp.int32)
        mask = abstract((1, 1, batch, batch * context), jnp.bfloat16)
        inputs = (ids, ids, lengths, lengths, abstract((groups, batch), jnp.int32), reads, mask)

    def forward(params: Any, buffers: Any, cache: Any, *batch_inputs: Any) -> Any:
        t_params, t_buffers, t_cache, t_inputs = env.j2t_iso((params, buffers, cache, batch_inputs))
        input_ids, position_ids, cu_q, cu_k, writes, *rest = t_inputs
        with env:
            _bind(paged, t_cache)
            kwargs = {
                "position_ids": position_ids,
                "cu_seq_lens_q": cu_q,
                "max_length_q": 1,
                "cu_seq_lens_k": {"full_attention": cu_k},
                "max_length_k": {"full_attention": context},
                "write_index": list(writes),
                "cache": paged,
                "logits_indices": torch.arange(batch),
                "use_cache": False,
            }
            if block_table:
                kwargs.update(block_table=rest[0], read_index=[], is_causal=True)
                kwargs["max_length_k"] = {"full_attention": 1}
            else:
                kwargs.update(read_index=list(rest[0]), attention_mask=rest[1], is_causal=False)
            out = torch.func.functional_call(model, {**t_params, **t_buffers}, (input_ids,), kwargs)
            return env.t2j_iso((out.logits, t_cache))

    function = _on_attention(model, serving, forward) if block_table else forward

    # Live KV: B x C tokens (read once), the B new tokens written; the rest of the buffer
    # (trash sectors, spare pages) is not traffic.
    token = _token_kv_bytes(model.config, shape.kv_cache_dtype)
    buffer_bytes = _tree_bytes(buffer)
    correction = batch * context * token + batch * token - buffer_bytes
    return DecodeStep(function, buffer, inputs, correction)
