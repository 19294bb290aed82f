"""Which Transformers attention modules this kernel cannot serve exactly (kernelize's hook).

``kernelize`` asks ``integrations.module_problem(module)`` for every module that dispatches
through ``AttentionInterface`` and leaves the model's attention on its stock implementation,
with this reason in the report, when one needs a feature ``attention_forward`` does not
implement. Read from the module class's forward (the keywords it passes) and the module's head
dims, so a new architecture using such a feature is refused without being listed here.
"""

from __future__ import annotations

import inspect

import torch

UNSUPPORTED_KEYWORDS = {
    "s_aux": "attention sinks (s_aux)",
    "sinks": "attention sinks",
    "position_bias": "an additive position bias (position_bias)",
    "indices": "sparse attention indices",
    "block_indices": "sparse block indices",
    "head_mask": "a head mask",
}
"""Keyword a forward passes -> the feature it asks of the attention function."""


def _keywords_passed(cls: type) -> set[str]:
    """Keyword names of the calls in ``cls.forward`` (decorators unwrapped)."""
    forward = inspect.unwrap(getattr(cls, "forward", None) or (lambda: None))
    code = getattr(forward, "__code__", None)
    if code is None:
        return set()
    return {
        name
        for const in code.co_consts
        if isinstance(const, tuple)
        for name in const
        if isinstance(name, str)
    }


def module_problem(module: torch.nn.Module) -> str | None:
    """Why ``attention_forward`` would not compute ``module``'s attention exactly, or None."""
    needed = sorted(_keywords_passed(type(module)) & UNSUPPORTED_KEYWORDS.keys())
    if needed:
        features = ", ".join(UNSUPPORTED_KEYWORDS[k] for k in needed)
        return f"{type(module).__name__} passes {features}, which this kernel does not implement"
    qk, v = getattr(module, "qk_head_dim", None), getattr(module, "v_head_dim", None)
    if isinstance(qk, int) and isinstance(v, int) and qk != v:
        return (
            f"{type(module).__name__} has value head dim {v} != query/key head dim {qk} "
            "(multi-head latent attention), which this kernel does not implement"
        )
    return None
