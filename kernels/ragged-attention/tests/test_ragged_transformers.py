"""generate_batch on kernelized tiny models returns exactly the greedy tokens of generate().

``max_batch_tokens=24`` makes batches mix chunked prefill with decode; page size 16 puts page
boundaries inside prefill chunks. The Pallas kernels run (interpret mode): the fixture puts
them first and records each trace, so a test shows which kernel ran, not a fallback.
"""

from __future__ import annotations

import types

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    ContinuousBatchingConfig,
    GenerationConfig,
    MistralForCausalLM,
)

import kernel_hub as kh  # noqa: E402
from kernel_hub.errors import KernelHubError, KernelInputError  # noqa: E402
from kernel_hub.layers.integrations import serving_cache  # noqa: E402
from kernel_hub.layers.integrations.continuous_batching import (  # noqa: E402
    ContinuousBatchingError,
    generate_batch,
)
from kernel_hub.models.tiny import build_tiny_model, tiny_model  # noqa: E402
from kernel_hub.testing import greedy_continuations  # noqa: E402

PROMPTS = [[(7 * i + 3 * j) % 120 + 2 for j in range(n)] for i, n in enumerate([30, 3, 19, 5])]
NEW_TOKENS = 5
GREEDY = GenerationConfig(
    max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1, pad_token_id=0
)


def _mistral():
    """Mistral with an 8-token sliding window: prompts longer than it need the window."""
    return tiny_model(MistralForCausalLM, sliding_window=8, pad_token_id=0)


MODELS = {
    "llama": lambda: build_tiny_model("llama"),
    "mistral-window": _mistral,
    "mixtral": lambda: build_tiny_model("mixtral"),
}


def _batching_config(**extra) -> ContinuousBatchingConfig:
    return ContinuousBatchingConfig(num_blocks=32, max_batch_tokens=24, page_size=16, **extra)


def _generate_batch(model, kv_cache_dtype=None, **extra) -> list[list[int]]:
    results = generate_batch(
        model,
        PROMPTS,
        generation_config=GREEDY,
        continuous_batching_config=_batching_config(**extra),
        kv_cache_dtype=kv_cache_dtype,
    )
    return [results[f"req_{i}"].generated_tokens for i in range(len(PROMPTS))]


@pytest.mark.parametrize("name", list(MODELS))
def test_generate_batch_matches_generate(pallas_traces, name):
    model = MODELS[name]()
    expected = greedy_continuations(model, PROMPTS, GREEDY)
    report = kh.kernelize(model)
    batching = [e for e in report.entries if e.kind == "continuous batching"]
    assert batching and all(e.swapped for e in batching), report
    pallas_traces.prefer_pallas()
    previous = model.config._attn_implementation

    assert _generate_batch(model) == expected
    assert len(set(pallas_traces["ragged"])) > 1, "prefill, mixed and decode batches: the kernel"
    assert not pallas_traces["paged"]
    assert model.config._attn_implementation == previous, "the manager restores attention"

    if name != "mistral-window":  # sliding-window layers have no block tables
        assert _generate_batch(model, max_blocks_per_request=4) == expected
        assert pallas_traces["paged"], "decode batches ran the paged kernel"
    assert greedy_continuations(model, PROMPTS, GREEDY) == expected, (
        "generate() after batching is unchanged"
    )

    kh.unkernelize(model)
    assert "init_continuous_batching" not in model.__dict__
    assert model.config._attn_implementation == "sdpa"


# First-order bound on the logits' error, as a fraction of the largest logit: each cached element
# is within half a step of its row (``kv_quant``): e4m3 keeps 3 mantissa bits (2**-4 of the
# element), int8 a step of max|row| / 127 (1/254 < 2**-7 of the row's largest); attention mixes
# cached values with weights summing to one, so its outputs, and the logits of this 2-layer
# model, move by at most that fraction of their scale.
KV_BOUND = {"float8_e4m3fn": 2.0**-4, "int8": 2.0**-7}


def test_generate_batch_with_an_8bit_kv_cache(pallas_traces):
    """Prefill and mixed batches write the 8-bit cache (fp8, then int8) and run the ragged
    kernel on each request's 8-bit history (the index path), decode batches run the paged
    kernel on 8-bit pages. The measured errors are printed."""
    model = build_tiny_model("llama")
    kh.kernelize(model)
    pallas_traces.prefer_pallas()
    logits = []
    model.lm_head.register_forward_hook(lambda module, args, out: logits.append(out.clone()))

    runs = {}
    for kind in (None, *KV_BOUND):
        logits.clear()
        tokens = _generate_batch(model, kv_cache_dtype=kind, max_blocks_per_request=4)
        runs[kind] = (tokens, list(logits))
    tokens, exact = runs[None]
    seen = pallas_traces["key_dtypes"]
    assert seen["ragged"] == seen["paged"] == {"float32", *KV_BOUND}, seen
    for kind, bound in KV_BOUND.items():
        quantized_tokens, quantized = runs[kind]
        assert [x.shape for x in exact] == [x.shape for x in quantized], "the same batches ran"
        error = max(
            float((a - b).abs().max() / a.abs().max())
            for a, b in zip(exact, quantized, strict=True)
        )
        print(f"{kind} KV cache: max logit error {error:.2e} of the largest logit, per step")
        assert error <= bound, kind
        assert quantized_tokens == tokens, kind


def test_kv_cache_dtype_is_checked(ragged):
    model = build_tiny_model("llama")
    with pytest.raises(KernelHubError, match="needs a kernelized model"):
        generate_batch(model, PROMPTS, kv_cache_dtype="int8")
    kh.kernelize(model)
    with pytest.raises(
        KernelHubError, match="'float16' is not supported; valid: float8_e4m3fn, int8"
    ):
        generate_batch(model, PROMPTS, kv_cache_dtype="float16")
    kernel_side = ragged.jax.kv_quant.KV_CACHE_DTYPES
    assert tuple(serving_cache.KV_CACHE_DTYPES) == kernel_side
    built = types.SimpleNamespace(batch_processor=object())  # a persistent manager, reused
    with pytest.raises(KernelHubError, match="already built its cache"):
        serving_cache.use_serving_cache(built, torch.int8)


def test_errors_in_the_batching_thread_are_raised(ragged, monkeypatch):
    model = build_tiny_model("llama")
    kh.kernelize(model)

    def broken(*args, **kwargs):
        raise KernelInputError("ragged_attention: bad input for the test")

    monkeypatch.setattr(ragged.KERNEL.integration("transformers"), "ragged_attention", broken)
    with pytest.raises(ContinuousBatchingError, match="bad input for the test"):
        generate_batch(
            model,
            PROMPTS[:2],
            generation_config=GREEDY,
            continuous_batching_config=_batching_config(),
        )


def test_unknown_arguments_are_refused(ragged):
    q = torch.zeros(1, 4, 2, 16)
    k = torch.zeros(1, 2, 2, 16)
    cu = torch.tensor([0, 2], dtype=torch.int32)
    with pytest.raises(KernelInputError, match=r"\['head_mask'\] are not implemented"):
        ragged.KERNEL.integration("transformers").continuous_batching_attention(
            torch.nn.Module(),
            q,
            k,
            k,
            None,
            cu_seq_lens_q=cu,
            cu_seq_lens_k=cu,
            head_mask=torch.ones(1),
        )
    with pytest.raises(KernelInputError, match="serves continuous batching calls"):
        ragged.KERNEL.integration("transformers").continuous_batching_attention(
            torch.nn.Module(), q, k, k, None
        )
