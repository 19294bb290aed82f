"""kernel-hub's AttentionMaskInterface entry describes every mask Transformers composes from its
own factories exactly: the description, evaluated the way the kernel evaluates it
(``masking.dense_mask`` on the arrays the op receives) and the way the dense paths do
(``MaskDescription.dense``), equals Transformers' ``sdpa_mask`` entry for entry."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import LlamaConfig  # noqa: E402
from transformers import masking_utils as mu  # noqa: E402
from transformers.cache_utils import StaticCache  # noqa: E402

from kernel_hub.models.tiny import tiny_config  # noqa: E402

BATCH, LENGTH = 2, 20


@pytest.fixture(scope="module")
def name(attention):
    return attention.KERNEL.integration("transformers").register()


def _config(implementation: str, **extra) -> LlamaConfig:
    config = tiny_config(LlamaConfig, hidden_size=16, num_attention_heads=2, **extra)
    config._attn_implementation = implementation
    return config


def _padding(left: int = 3, right: int = 2) -> torch.Tensor:
    mask = torch.ones(BATCH, LENGTH, dtype=torch.long)
    mask[0, :left] = 0
    mask[1, LENGTH - right :] = 0
    return mask


def _image_blocks() -> torch.Tensor:
    ids = torch.full((BATCH, LENGTH), -1)
    ids[0, 4:9] = 0
    ids[0, 12:15] = 1
    ids[1, 0:6] = 0
    return ids


def _packed_positions() -> torch.Tensor:
    return torch.cat([torch.arange(7), torch.arange(9), torch.arange(4)])[None].repeat(BATCH, 1)


def _kernel_mask(attention, description) -> np.ndarray:
    """What the kernel computes: ``masking.dense_mask`` of the op's per-token arrays."""
    api, masking = attention.jax, attention.jax.masking

    def j(x):
        return None if x is None else jnp.asarray(x.numpy())

    spec = masking.AttentionSpec(
        causal=description.causal,
        sliding_window=description.sliding_window,
        window_bounds_groups=description.window_bounds_groups,
    ).resolved(8)
    query = jnp.zeros((description.shape[0], 1, description.q_len, 8))
    key = jnp.zeros((description.shape[0], 1, description.kv_len, 8))
    tokens = api._prepare(
        query,
        key,
        j(description.kv_valid),
        j(description.q_segment_ids),
        j(description.kv_segment_ids),
        j(description.q_positions),
        j(description.kv_positions),
        j(description.q_groups),
        j(description.kv_groups),
    )
    mask = masking.dense_mask(description.q_len, description.kv_len, spec, tokens)
    return np.broadcast_to(np.asarray(mask), (description.shape[0], 1, *mask.shape[2:]))


CASES = {
    "causal-left-right-padding": (mu.create_causal_mask, {}, {"attention_mask": _padding()}),
    "sliding-window-padding": (
        mu.create_sliding_window_causal_mask,
        {"sliding_window": 5},
        {"attention_mask": _padding()},
    ),
    "chunked-left-padding": (
        mu.create_chunked_causal_mask,
        {"attention_chunk_size": 6},
        {"attention_mask": _padding(left=4, right=0)},
    ),
    "packed-position-ids": (
        mu.create_causal_mask,
        {},
        {"attention_mask": None, "position_ids": _packed_positions()},
    ),
    "packed-chunked": (
        mu.create_chunked_causal_mask,
        {"attention_chunk_size": 4},
        {"attention_mask": None, "position_ids": _packed_positions()},
    ),
    "image-blocks-padding": (
        mu.create_causal_mask,
        {},
        {"attention_mask": _padding(), "block_sequence_ids": _image_blocks()},
    ),
    "image-blocks-sliding": (
        mu.create_sliding_window_causal_mask,
        {"sliding_window": 4},
        {"attention_mask": _padding(), "block_sequence_ids": _image_blocks()},
    ),
    "gemma3-window-after-blocks": (
        mu.create_causal_mask,
        {},
        {
            "attention_mask": _padding(),
            "or_mask_function": mu.blockwise_overlay(_image_blocks()),
            "and_mask_function": mu.sliding_window_overlay(3),
        },
    ),
    "bidirectional-padding": (mu.create_bidirectional_mask, {}, {"attention_mask": _padding()}),
    "modernbert-two-way-window": (
        mu.create_bidirectional_sliding_window_mask,
        {"sliding_window": 3},
        {"attention_mask": _padding()},
    ),
    "cross-attention-encoder-padding": (
        mu.create_bidirectional_mask,
        {},
        {"attention_mask": _padding()[:, :13], "encoder_hidden_states": torch.zeros(BATCH, 13, 16)},
    ),
}


def _build(factory, config, kwargs, length=LENGTH, cache=None):
    inputs = torch.zeros(BATCH, length, 16)
    arguments = {"config": config, "inputs_embeds": inputs, **kwargs}
    if factory is not mu.create_bidirectional_mask:
        arguments["cache"] = cache
    return factory(**arguments)


@pytest.mark.parametrize("case", list(CASES))
def test_description_equals_sdpa_mask(attention, name, case):
    factory, extra, kwargs = CASES[case]
    description = _build(factory, _config(name, **extra), kwargs)
    assert isinstance(description, attention.KERNEL.integration("transformers").MaskDescription), (
        description
    )
    stock = _build(factory, _config("sdpa", **extra), kwargs)
    if stock is None:  # SDPA left it out: plain causal or bidirectional over every key
        pytest.fail(f"{case}: Transformers built no mask; the case tests nothing")
    stock = stock.expand(BATCH, 1, -1, -1).numpy()
    assert np.array_equal(description.dense().numpy(), stock), case
    assert np.array_equal(_kernel_mask(attention, description), stock), case


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_static_cache_prefill_and_decode_offsets(attention, name, compiled):
    """A static cache holds 32 slots: a padded 20-token prompt, then one decode step at
    position 20; the description needs explicit positions (queries are not end-aligned; the
    cache's query offset is a tensor), built eagerly or inside ``torch.compile``."""
    description_class = attention.KERNEL.integration("transformers").MaskDescription
    padding = _padding(left=5, right=0)
    for step, (length, mask) in enumerate(
        [(LENGTH, padding), (1, torch.cat([padding, torch.ones(BATCH, 1, dtype=torch.long)], 1))]
    ):
        masks = {}
        for implementation in (name, "sdpa"):
            config = _config(implementation, max_position_embeddings=64)
            cache = StaticCache(config=config, max_cache_len=32)
            if step:
                _fill(cache, config)

            def build(mask, config=config, cache=cache, length=length):
                kwargs = {"attention_mask": mask, "allow_is_causal_skip": False}
                d = _build(mu.create_causal_mask, config, kwargs, length=length, cache=cache)
                if not isinstance(d, description_class):
                    return d
                return (d.q_len, d.kv_len, d.causal, d.sliding_window, d.window_bounds_groups), (
                    d.arrays()
                )

            if compiled:
                torch._dynamo.reset()
                build = torch.compile(build, backend="eager", fullgraph=True)
            masks[implementation] = build(mask)
        (rule, arrays), stock = masks[name], masks["sdpa"].expand(BATCH, 1, -1, -1).numpy()
        description = description_class(*rule, *arrays)
        assert description.q_positions is not None
        assert np.array_equal(description.dense().numpy(), stock), step
        assert np.array_equal(_kernel_mask(attention, description), stock), step


def _fill(cache, config) -> None:
    """What a prefill of LENGTH tokens leaves in the cache."""
    keys = torch.zeros(BATCH, config.num_key_value_heads, LENGTH, 8)
    for index in range(len(cache.layers)):
        cache.update(keys, keys, index)


def test_unknown_mask_function_falls_back_to_dense_with_reason(attention, name, caplog):
    description = _build(
        mu.create_causal_mask,
        _config(name),
        {"attention_mask": _padding(), "or_mask_function": lambda b, h, q, k: q == k + 7},
    )
    assert isinstance(description, torch.Tensor) and description.shape == (BATCH, 1, 20, 20)
    assert "not one of masking_utils' factories" in caplog.text


def _mllama_cross_mask(dtype=torch.float32) -> torch.Tensor:
    """Mllama's own cross-attention mask (``_prepare_cross_attention_mask``): two images of two
    tiles, 3 vision tokens per tile; row 0 sees image 0 from token 4 and both from token 9, row
    1 only image 1's first tile from token 2; tokens before any image see every key."""
    from transformers.models.mllama.modeling_mllama import _prepare_cross_attention_mask

    cross = torch.zeros(BATCH, LENGTH, 2, 2, dtype=torch.long)
    cross[0, 4:, 0, :] = 1
    cross[0, 9:, 1, :] = 1
    cross[1, 2:, 1, :1] = 1
    return _prepare_cross_attention_mask(cross, 3, dtype)[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool])
def test_nested_model_masks_become_positions(attention, dtype):
    """Mllama's cross-attention mask (additive, or as booleans) is read exactly as positions."""
    additive = _mllama_cross_mask(torch.float32 if dtype == torch.bool else dtype)
    mask = additive == 0 if dtype == torch.bool else additive
    description = attention.KERNEL.integration("transformers").describe_nested(mask)
    assert description is not None and description.causal
    want = (additive == 0).numpy()
    assert np.array_equal(_kernel_mask(attention, description), want)
    assert torch.equal(description.dense(), additive == 0)


def test_masks_that_are_not_nested_stay_dense(attention):
    describe = attention.KERNEL.integration("transformers").describe_nested
    mask = _mllama_cross_mask() == 0
    crossed = mask.clone()
    crossed[0, 0, 5] = ~crossed[0, 0, 5]  # one query sees a set no other contains
    crossed[0, 0, 5, :3] = False
    crossed[0, 0, 5, 6:9] = True
    assert describe(crossed) is None
    empty = mask.clone()
    empty[1, 0, 3] = False  # a query that sees no key: its convention differs by implementation
    assert describe(empty) is None
    biased = torch.where(mask, 0.5, torch.finfo(torch.float32).min)  # not just 0 / minimum
    assert describe(biased) is None


def _compiled_description(attention, name, case, tensors: dict):
    """The case's description built inside ``torch.compile(fullgraph=True)``, rebuilt outside
    from what the graph returns (its rule and arrays)."""
    factory, extra, kwargs = CASES[case]
    config = _config(name, **extra)
    description_class = attention.KERNEL.integration("transformers").MaskDescription
    static = {k: v for k, v in kwargs.items() if k not in tensors}

    def build(**tensors):
        d = _build(factory, config, {**static, **tensors})
        rule = (d.q_len, d.kv_len, d.causal, d.sliding_window, d.window_bounds_groups)
        return rule, d.arrays()

    rule, arrays = torch.compile(build, backend="eager", fullgraph=True)(**tensors)
    return description_class(*rule, *arrays)


@pytest.mark.parametrize("case", list(CASES))
def test_compiled_description_equals_sdpa_mask(attention, name, case):
    """The same descriptions built under ``torch.compile(fullgraph=True)`` (the factories' graph
    substitutes), and the compiled function called again with another padding pattern."""
    factory, extra, kwargs = CASES[case]
    tensors = {k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
    torch._dynamo.reset()
    patterns = [tensors]
    if kwargs.get("attention_mask") is not None:
        other = _padding(left=1, right=6)[:, : kwargs["attention_mask"].shape[1]]
        patterns.append({**tensors, "attention_mask": other})
    for pattern in patterns:
        description = _compiled_description(attention, name, case, pattern)
        stock = _build(factory, _config("sdpa", **extra), {**kwargs, **pattern})
        stock = stock.expand(BATCH, 1, -1, -1).numpy()
        assert np.array_equal(description.dense().numpy(), stock), case
        assert np.array_equal(_kernel_mask(attention, description), stock), case


def _overlay(sliding_window: int):
    """A factory like ``sliding_window_overlay`` that has no graph substitute."""

    def inner(batch_idx, head_idx, q_idx, kv_idx):
        return kv_idx > q_idx - sliding_window

    return inner


def test_compiled_closure_without_substitute_gets_the_dense_mask(attention, name, monkeypatch):
    """A closure built while compiling by a factory without a graph substitute (here one the
    walk is told is a window): dynamo cannot read its cells, so the dense mask, no failure."""
    masks = attention.KERNEL.integration("transformers").mask_interface.__globals__
    codes = {**masks["_CODES"], masks["_key"](_overlay(1).__code__): "window"}
    monkeypatch.setitem(masks, "_CODES", codes)

    def build(padding):
        mask_function = mu.and_masks(_overlay(5), mu.causal_mask_function)
        return masks["mask_interface"](BATCH, LENGTH, LENGTH, 0, 0, mask_function, padding)

    assert not isinstance(build(_padding()), torch.Tensor)  # eagerly the walk reads it
    torch._dynamo.reset()
    got = torch.compile(build, backend="eager", fullgraph=True)(_padding())
    want = mu.sdpa_mask(
        batch_size=BATCH,
        q_length=LENGTH,
        kv_length=LENGTH,
        mask_function=mu.sliding_window_causal_mask_function(5),
        attention_mask=_padding().bool(),
    )
    assert isinstance(got, torch.Tensor) and torch.equal(got, want)


def test_compiled_unknown_mask_function_gets_the_dense_mask(attention, name):
    """A mask function the walk does not know: the dense mask under fullgraph too (no warning,
    which would break the graph)."""
    config = _config(name)

    def build(padding):
        return _build(
            mu.create_causal_mask,
            config,
            {"attention_mask": padding, "or_mask_function": lambda b, h, q, k: q == k + 7},
        )

    torch._dynamo.reset()
    got = torch.compile(build, backend="eager", fullgraph=True)(_padding())
    assert isinstance(got, torch.Tensor) and torch.equal(got, build(_padding()))
