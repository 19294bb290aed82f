"""kernelize touches only the model it is given.

Two models built from one config object share it (``AutoModelForCausalLM.from_config(cfg)``
twice), as do a stock model and its kernelized copy, a teacher and its student. Kernelizing one
must leave the other bit-identical to a model that was never kernelized, in inference and in
training, before and after ``unkernelize``; and nothing process-wide that the other model reads
(its classes, its modeling module's globals, ``masking_utils``) may change.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma2Config, LlamaConfig

import kernel_hub
from kernel_hub.errors import KernelHubError
from kernel_hub.models.tiny import PAD_TOKEN_ID, tiny_config

CONFIGS = {
    # SDPA attention, Llama's norm/MLP/rotary forms
    "llama-sdpa": lambda: tiny_config(LlamaConfig, pad_token_id=PAD_TOKEN_ID),
    # eager attention with soft-capping and a sliding window: the case measured in the issue
    "gemma2-eager": lambda: tiny_config(
        Gemma2Config,
        head_dim=16,
        sliding_window=4,
        pad_token_id=PAD_TOKEN_ID,
        attn_implementation="eager",
    ),
}

INPUT_IDS = torch.tensor([[PAD_TOKEN_ID, PAD_TOKEN_ID, 5, 9, 17, 3], [7, 8, 9, 10, 11, 12]])
ATTENTION_MASK = (INPUT_IDS != PAD_TOKEN_ID).long()
LABELS = INPUT_IDS.clone()  # labels on padding too: the loss reads fully masked query rows


def _outputs(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Inference logits, then a training loss and every parameter's gradient."""
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=INPUT_IDS, attention_mask=ATTENTION_MASK).logits
    model.train()
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=INPUT_IDS, attention_mask=ATTENTION_MASK, labels=LABELS).loss
    loss.backward()
    grads = {f"grad {n}": p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    model.eval()
    return {"logits": logits, "loss": loss.detach(), **grads}


def _assert_identical(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), f"{key} changed"


TRANSFORMERS_MEMOS = frozenset({"_can_set_attn_implementation_cached_value"})
"""Class attributes Transformers itself memoizes on first use of ``set_attn_implementation`` (a
pure function of the class's source, the same for every instance): not state kernelize adds."""


def _global_state(model: torch.nn.Module) -> dict[str, dict[str, object]]:
    """What a model reads besides its own instances: its module classes' attributes, the
    globals of the modules defining them, and ``masking_utils``'s globals (by identity)."""
    import transformers.masking_utils as masking_utils

    state: dict[str, dict[str, object]] = {}
    modules = {masking_utils.__name__: masking_utils}
    for module in model.modules():
        for cls in type(module).__mro__:
            if cls.__module__.startswith("transformers."):
                attributes = {k: v for k, v in vars(cls).items() if k not in TRANSFORMERS_MEMOS}
                state[f"class {cls.__qualname__}"] = attributes
                modules[cls.__module__] = sys.modules[cls.__module__]
    for name, module in modules.items():
        state[f"module {name}"] = {
            k: v for k, v in vars(module).items() if not isinstance(v, types.ModuleType)
        }
    return state


def _assert_same_state(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for where in want:
        changed = [
            k
            for k in want[where].keys() | got[where].keys()
            if want[where].get(k, "<absent>") is not got[where].get(k, "<absent>")
        ]
        assert not changed, f"kernelize changed {where}: {sorted(changed)}"


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_kernelize_leaves_a_model_sharing_its_config_untouched(family: str) -> None:
    config = CONFIGS[family]()
    torch.manual_seed(0)
    untouched = AutoModelForCausalLM.from_config(config)
    torch.manual_seed(1)
    kernelized = AutoModelForCausalLM.from_config(config)
    assert untouched.config is kernelized.config, "the premise: one config object, shared"
    stock_implementation = untouched.config._attn_implementation
    before = _outputs(untouched)
    state = _global_state(untouched)
    stock_kernelized = _outputs(kernelized)

    report = kernel_hub.kernelize(kernelized, mode="training")
    switched = [e for e in report.entries if e.kind == "attention"]
    assert switched and all(e.swapped for e in switched), report
    assert kernelized.config is not config, "the kernelized model got its own config"
    assert kernelized.config._attn_implementation != stock_implementation
    assert all(
        m.config is kernelized.config
        for m in kernelized.modules()
        if isinstance(getattr(m, "config", None), type(config))
    ), "sharing inside the kernelized model is kept"

    assert untouched.config is config
    assert config._attn_implementation == stock_implementation
    _assert_identical(_outputs(untouched), before)
    _assert_same_state(_global_state(untouched), state)
    with pytest.raises(KernelHubError, match="never kernelized"):
        kernel_hub.kernelize_report(untouched)

    kernel_hub.kernelize(kernelized, mode="training")  # again: keeps the copy it made
    assert untouched.config is config and config._attn_implementation == stock_implementation

    kernel_hub.unkernelize(kernelized)
    _assert_identical(_outputs(untouched), before)
    _assert_same_state(_global_state(untouched), state)
    assert kernelized.config._attn_implementation == stock_implementation
    unkernelized = _outputs(kernelized)
    for key, want in stock_kernelized.items():  # back to stock: same computation as before
        assert torch.equal(unkernelized[key], want), f"{key} after unkernelize"
