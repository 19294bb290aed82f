"""The integration honours or refuses every keyword: the harmless list, refused features, unknown
keywords, and kernelize leaving a model alone whose attention passes a refused feature."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")


def _qkv(seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 4, 6, 8, generator=generator)
    k = torch.randn(1, 2, 6, 8, generator=generator)
    return q, k, torch.randn(1, 2, 6, 8, generator=generator)


def _sample(name: str):
    """A realistic non-None value for a keyword."""
    if name.startswith("cu_seq_lens"):
        return torch.tensor([0, 6], dtype=torch.int32)
    if name in ("position_ids", "cache_position", "encoder_hidden_states"):
        return torch.arange(6)[None]
    if name.startswith("max_length"):
        return 6
    return True


def test_harmless_keywords_do_not_change_the_result(attention):
    forward = attention.KERNEL.integration("transformers").attention_forward
    q, k, v = _qkv()
    want, _ = forward(torch.nn.Module(), q, k, v, None)
    for name in attention.KERNEL.integration("transformers").keywords.HARMLESS:
        got, _ = forward(torch.nn.Module(), q, k, v, None, **{name: _sample(name)})
        assert torch.equal(got, want), name


@pytest.mark.parametrize("name", ["sinks", "indices", "block_indices", "head_mask"])
def test_refused_features_raise_and_name_the_feature(attention, name):
    from kernel_hub.errors import KernelInputError

    forward = attention.KERNEL.integration("transformers").attention_forward
    q, k, v = _qkv()
    forward(torch.nn.Module(), q, k, v, None, **{name: None})  # absent feature: fine
    with pytest.raises(KernelInputError, match=f"keyword '{name}' .*not implemented"):
        forward(torch.nn.Module(), q, k, v, None, **{name: torch.zeros(4)})


def test_unknown_keywords_are_refused_unless_none(attention):
    from kernel_hub.errors import KernelInputError

    forward = attention.KERNEL.integration("transformers").attention_forward
    q, k, v = _qkv()
    forward(torch.nn.Module(), q, k, v, None, some_future_option=None)
    with pytest.raises(KernelInputError, match=r"unknown keyword 'some_future_option'=0\.5"):
        forward(torch.nn.Module(), q, k, v, None, some_future_option=0.5)


def test_packed_sequences_need_a_mask(attention):
    from kernel_hub.errors import KernelInputError

    forward = attention.KERNEL.integration("transformers").attention_forward
    q, k, v = _qkv()
    packed = torch.tensor([0, 2, 6], dtype=torch.int32)
    with pytest.raises(KernelInputError, match="2 packed sequences but no attention mask"):
        forward(torch.nn.Module(), q, k, v, None, cu_seq_lens_q=packed)
    segments = torch.tensor([0, 0, 1, 1, 1, 1])
    mask = (segments[:, None] == segments[None, :]) & torch.ones(6, 6, dtype=torch.bool).tril()
    got, _ = forward(torch.nn.Module(), q, k, v, mask[None, None], cu_seq_lens_q=packed)
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, enable_gqa=True
    ).transpose(1, 2)
    assert (got - want).abs().max() <= 1e-5


def test_kernelize_leaves_attention_passing_a_refused_feature_alone(attention):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaAttention

    from kernel_hub.layers.kernelize import kernelize
    from kernel_hub.models.tiny import build_tiny_model

    class SparseAttention(LlamaAttention):
        """A stand-in for DeepSeek-V3.2-style sparse attention: it passes selected key indices."""

        def forward(self, hidden_states, position_embeddings, attention_mask, **kwargs):
            interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation)
            return interface(self, hidden_states, hidden_states, hidden_states, None, indices=None)

    model = build_tiny_model("llama")
    model.model.layers[0].self_attn.__class__ = SparseAttention
    report = kernelize(model, mode="inference")
    entries = [e for e in report.entries if e.kind == "attention"]
    assert entries and not any(e.swapped for e in entries), report
    assert all("SparseAttention.forward passes 'indices'" in e.reason for e in entries), report
    assert model.config._attn_implementation == "sdpa"
    assert (
        attention.KERNEL.integration("transformers").module_problem(model.model.layers[1].self_attn)
        is None
    )


class _ReadsMaskDtype(torch.nn.Module):
    def forward(self, hidden_states, attention_mask=None):
        if attention_mask.dtype == torch.bool:  # re-masks by the mask tensor's dtype
            return hidden_states
        return -hidden_states


class _GuardsMaskType(torch.nn.Module):
    def forward(self, hidden_states, attention_mask=None):
        if isinstance(attention_mask, torch.Tensor) and attention_mask.shape[-1] > 1:
            return -hidden_states
        return hidden_states


class _TakesMergedMask(torch.nn.Module):
    def forward(self, hidden_states, merged_attention_mask=None):
        return hidden_states


@pytest.mark.parametrize(
    ("module", "reason"),
    [
        (_ReadsMaskDtype(), "reads the attention mask as a tensor (attention_mask.dtype"),
        (_TakesMergedMask(), "takes merged_attention_mask"),
        (_GuardsMaskType(), None),
    ],
)
def test_modules_using_the_mask_as_a_tensor_are_left_alone(attention, module, reason):
    """The mask function returns a description, not a tensor: a forward that reads the mask's
    attributes or takes a concatenated mask (Qwen4-Exp, T5Gemma 2) is refused at kernelize time;
    one that checks the type first is not."""
    problem = attention.KERNEL.integration("transformers").module_problem(module)
    assert (problem is None) if reason is None else (reason in problem), problem
