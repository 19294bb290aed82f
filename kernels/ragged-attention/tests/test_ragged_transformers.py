"""generate_batch on kernelized tiny models returns exactly the greedy tokens of generate().

``max_batch_tokens=24`` makes batches mix chunked prefill with decode; page size 16 puts page
boundaries inside prefill chunks. The Pallas kernels run (interpret mode): the fixture puts
them first and records each trace, so a test shows which kernel ran, not a fallback.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    ContinuousBatchingConfig,
    GenerationConfig,
    MistralForCausalLM,
)

import kernel_hub as kh  # noqa: E402
from kernel_hub.errors import KernelInputError  # noqa: E402
from kernel_hub.layers.integrations.continuous_batching import (  # noqa: E402
    ContinuousBatchingError,
    generate_batch,
)
from kernel_hub.models.tiny import build_tiny_model, tiny_model  # noqa: E402

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


class PallasTraces(dict):
    """{"ragged": [...], "paged": [...]}: the query shape of each trace of each Pallas kernel."""

    def __init__(self, tables):
        super().__init__(ragged=[], paged=[])
        self.tables = tables

    def prefer_pallas(self) -> None:
        """Put Pallas first on CPU; after kernelize, which applies the registry's order."""
        import jax

        jax.clear_caches()
        for table in self.tables:
            table.set_order("cpu", ("pallas", "xla"))


@pytest.fixture
def pallas_traces(ragged):
    """Records the Pallas kernels' traces; restores the implementation order afterwards."""
    import jax

    api = ragged.jax
    tables = (api.RAGGED_TABLE, api.PAGED_TABLE)
    saved = [t.order("cpu") for t in tables]
    traces = PallasTraces(tables)
    originals = (api.pallas_ragged.ragged_attention, api.pallas_paged.paged_attention)

    def recording(kind, original):
        def record(*args, **kwargs):
            traces[kind].append(tuple(args[0].shape))
            return original(*args, **kwargs)

        return record

    api.pallas_ragged.ragged_attention = recording("ragged", originals[0])
    api.pallas_paged.paged_attention = recording("paged", originals[1])
    try:
        yield traces
    finally:
        api.pallas_ragged.ragged_attention, api.pallas_paged.paged_attention = originals
        for table, order in zip(tables, saved, strict=True):
            table.set_order("cpu", order)
        jax.clear_caches()


def _greedy_generate(model) -> list[list[int]]:
    tokens = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=GREEDY)
            tokens.append(out[0, len(prompt) :].tolist())
    return tokens


def _batching_config(**extra) -> ContinuousBatchingConfig:
    return ContinuousBatchingConfig(num_blocks=32, max_batch_tokens=24, page_size=16, **extra)


def _generate_batch(model, **extra) -> list[list[int]]:
    results = generate_batch(
        model,
        PROMPTS,
        generation_config=GREEDY,
        continuous_batching_config=_batching_config(**extra),
    )
    return [results[f"req_{i}"].generated_tokens for i in range(len(PROMPTS))]


@pytest.mark.parametrize("name", list(MODELS))
def test_generate_batch_matches_generate(pallas_traces, name):
    model = MODELS[name]()
    expected = _greedy_generate(model)
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
    assert _greedy_generate(model) == expected, "generate() after batching is unchanged"

    kh.unkernelize(model)
    assert "init_continuous_batching" not in model.__dict__
    assert model.config._attn_implementation == "sdpa"


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
