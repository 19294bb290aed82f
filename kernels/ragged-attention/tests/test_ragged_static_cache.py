"""``generate`` with an 8-bit static KV cache (``static_kv_cache``) on a kernelized tiny Llama.

The Pallas kernels run first (interpret mode; the ``pallas_traces`` fixture records them): the
prefill runs ``ragged_attention`` on each sequence's 8-bit keys read back, every decode step
``paged_attention`` on the cache's 8-bit pages in place (page 8: several pages per sequence).
The reference is the same kernelized model's stock static ``generate`` (f32 ``StaticCache``).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import GenerationConfig, MistralForCausalLM  # noqa: E402

import kernel_hub as kh  # noqa: E402
from kernel_hub.errors import KernelHubError, KernelInputError  # noqa: E402
from kernel_hub.layers.integrations.static_kv_cache import (  # noqa: E402
    static_cache_class,
    static_kv_cache,
)
from kernel_hub.models.tiny import build_tiny_model, tiny_model  # noqa: E402

IDS = torch.tensor([[(7 * i + 3 * j) % 120 + 2 for j in range(11)] for i in range(3)])
GREEDY = GenerationConfig(
    max_new_tokens=5,
    do_sample=False,
    eos_token_id=-1,
    pad_token_id=0,
    cache_implementation="static",
    return_dict_in_generate=True,
)
# First-order bound on the logits' error, as a fraction of the largest logit: each cached element
# is within half a step of its row (``kv_quant``): e4m3 keeps 3 mantissa bits (2**-4 of the
# element), int8 a step of max|row| / 127 (1/254 < 2**-7 of the row's largest); attention mixes
# cached values with weights summing to one, so its outputs move by at most that fraction.
BOUND = {"float8_e4m3fn": 2.0**-4, "int8": 2.0**-7}


def _generate(model, logits):
    logits.clear()
    with torch.no_grad():
        out = model.generate(IDS, attention_mask=torch.ones_like(IDS), generation_config=GREEDY)
    return out, list(logits)


@pytest.fixture(scope="module")
def llama():
    model = build_tiny_model("llama")
    kh.kernelize(model)
    return model


def test_generate_with_an_8bit_static_cache(llama, pallas_traces):
    pallas_traces.prefer_pallas()
    logits = []
    hook = llama.lm_head.register_forward_hook(lambda m, args, out: logits.append(out.clone()))
    try:
        reference, exact = _generate(llama, logits)
        assert not pallas_traces["ragged"] and not pallas_traces["paged"]
        for kind, bound in BOUND.items():
            with static_kv_cache(llama, kind, page_size=8):
                out, quantized = _generate(llama, logits)
            layer = out.cache.layers[0]
            for pages in (layer.k_pages, layer.v_pages):
                assert pages.dtype == getattr(torch, kind)
                assert pages.shape == (3 * 2, 8, 2, 16)  # 15 slots: 2 pages a sequence
            assert llama.config._attn_implementation == "kernel_hub_attention", "restored"
            assert [x.shape for x in quantized] == [x.shape for x in exact]
            error = max(
                float((a - b).abs().max() / a.abs().max())
                for a, b in zip(exact, quantized, strict=True)
            )
            print(f"{kind} static KV cache: max logit error {error:.2e} of the largest logit")
            assert error <= bound
            assert torch.equal(out.sequences, reference.sequences), kind
    finally:
        hook.remove()
    seen = pallas_traces["key_dtypes"]
    assert seen["ragged"] == seen["paged"] == {"float8_e4m3fn", "int8"}, seen
    assert {shape[0] for shape in pallas_traces["paged"]} == {8}, "3 sequences, one query each"


def test_what_the_static_cache_refuses(llama):
    with (
        pytest.raises(KernelHubError, match="'float16' is not supported; valid"),
        static_kv_cache(llama, "float16"),
    ):
        pass
    with (
        pytest.raises(KernelHubError, match="needs a kernelized model"),
        static_kv_cache(build_tiny_model("llama"), "int8"),
    ):
        pass
    llama.config.is_encoder_decoder = True
    try:
        with pytest.raises(KernelHubError, match="is an encoder-decoder"):
            static_kv_cache(llama, "int8").__enter__()
    finally:
        llama.config.is_encoder_decoder = False
    with static_kv_cache(llama, "int8"):
        with pytest.raises(KernelHubError, match="do not nest"), static_kv_cache(llama, "int8"):
            pass
        with pytest.raises(KernelInputError, match="static serving cache"):
            llama.generate(IDS[:, :3], max_new_tokens=1)  # a dynamic cache
        padded = torch.ones_like(IDS)
        padded[0, 0] = 0
        with pytest.raises(KernelInputError, match="pads some sequences"):
            llama.generate(IDS, attention_mask=padded, generation_config=GREEDY)
        with pytest.raises(KernelHubError, match="beam"):
            llama.generate(IDS[:2, :3], generation_config=GREEDY, num_beams=2, max_new_tokens=2)
    assert llama.config._attn_implementation == "kernel_hub_attention"
    assert "_prepare_static_cache" not in llama.__dict__
    cache = static_cache_class()(llama.config, 4, kv_cache_dtype="int8")
    five = torch.zeros(1, 2, 5, 16)
    with pytest.raises(KernelHubError, match="holds 4 tokens a sequence; 0 are cached and 5"):
        cache.update(five, five, 0, kwargs={})
    with pytest.raises(KernelHubError, match=r"update\(\.\.\., kwargs=kwargs\).*cache_kwargs"):
        cache.update(five, five, 0, {"cache_position": None})  # an older model's call
    mistral = tiny_model(MistralForCausalLM, sliding_window=8).config
    mistral.layer_types = ["sliding_attention"] * mistral.num_hidden_layers
    with pytest.raises(KernelHubError, match=r"full-attention layers only.*sliding_attention"):
        static_cache_class()(mistral, 16, kv_cache_dtype="int8")
