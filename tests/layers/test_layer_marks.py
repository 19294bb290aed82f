"""How candidate modules are found: decorator, mark_layer, Transformers marks, known classes."""

from __future__ import annotations

import pytest
import torch
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.llama4.modeling_llama4 import Llama4TextRMSNorm
from transformers.models.mistral.modeling_mistral import MistralRMSNorm
from transformers.models.mixtral.modeling_mixtral import MixtralRMSNorm
from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeRMSNorm
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm

from kernel_hub import KernelHubError, mark_layer, unmark_layer, use_kernel_forward
from kernel_hub.layers.kernelize import LAYER_ATTRIBUTE, find_mark


class LocalNorm(torch.nn.Module):
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states


def test_decorator_sets_the_shared_attribute() -> None:
    @use_kernel_forward("RMSNorm")
    class Norm(LocalNorm):
        pass

    assert getattr(Norm, LAYER_ATTRIBUTE) == "RMSNorm"
    assert find_mark(Norm()) == ("RMSNorm", LAYER_ATTRIBUTE)
    assert find_mark(LocalNorm()) is None


@pytest.mark.parametrize("bad", ["", "RMS Norm", 3, None])
def test_decorator_rejects_bad_layer_names(bad: object) -> None:
    with pytest.raises(KernelHubError, match="identifier such as 'RMSNorm'"):
        use_kernel_forward(bad)


def test_decorator_only_takes_module_classes() -> None:
    with pytest.raises(KernelHubError, match=r"torch\.nn\.Module classes"):
        use_kernel_forward("RMSNorm")(object)


def test_mark_layer_by_class_and_by_name() -> None:
    class ByClass(LocalNorm):
        pass

    class ByName(LocalNorm):
        pass

    mark_layer(ByClass, "RMSNorm")
    assert find_mark(ByClass()) == ("RMSNorm", "mark_layer")
    qualified = f"{ByName.__module__}.{ByName.__qualname__}"
    for name in ("ByName", qualified):
        mark_layer(name, "RMSNorm")
        try:
            assert find_mark(ByName()) == ("RMSNorm", "mark_layer")
        finally:
            unmark_layer(name)
        assert find_mark(ByName()) is None


def test_mark_layer_wins_over_the_class_attribute() -> None:
    @use_kernel_forward("Other")
    class Norm(LocalNorm):
        pass

    mark_layer(Norm, "RMSNorm")
    assert find_mark(Norm()) == ("RMSNorm", "mark_layer")
    unmark_layer(Norm)
    assert find_mark(Norm()) == ("Other", LAYER_ATTRIBUTE)


def test_mark_layer_bad_target() -> None:
    with pytest.raises(KernelHubError, match="Module class or a class name"):
        mark_layer(42, "RMSNorm")
    with pytest.raises(KernelHubError, match="identifier"):
        mark_layer(LocalNorm, "not a name")


def test_transformers_marks_count_when_present() -> None:
    class MarkedLlamaNorm(LlamaRMSNorm):  # what an active use_kernel_forward_from_hub sets
        kernel_layer_name = "RMSNorm"

    assert find_mark(MarkedLlamaNorm(8)) == ("RMSNorm", LAYER_ATTRIBUTE)


@pytest.mark.parametrize(
    "cls", [LlamaRMSNorm, MistralRMSNorm, MixtralRMSNorm, Qwen2MoeRMSNorm, Qwen3MoeRMSNorm]
)
def test_llama_style_transformers_norms_are_recognised(cls: type) -> None:
    assert getattr(cls, LAYER_ATTRIBUTE, None) is None  # the Transformers stub set nothing
    assert find_mark(cls(8)) == ("RMSNorm", "recognised")


@pytest.mark.parametrize(
    ("cls", "layer"),
    [
        (GemmaRMSNorm, "RMSNormZeroCentered"),  # (x̂ * (1 + w)) in f32, cast last
        (Gemma3RMSNorm, "RMSNormZeroCentered"),
        (Qwen3NextRMSNorm, "RMSNormZeroCentered"),
        (Olmo2RMSNorm, "RMSNormF32Scale"),  # (w * x̂).to(x.dtype)
        (Llama4TextRMSNorm, "RMSNormOfX"),  # Llama's math, forward(self, x)
    ],
)
def test_other_norm_forms_get_their_own_layer(cls: type, layer: str) -> None:
    assert find_mark(cls(8)) == (layer, "recognised")


def test_only_transformers_classes_are_recognised() -> None:
    class MyRMSNorm(LlamaRMSNorm):  # Llama semantics, but the user's class: mark it explicitly
        pass

    assert find_mark(MyRMSNorm(8)) is None
