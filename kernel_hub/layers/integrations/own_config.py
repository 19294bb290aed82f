"""A kernelized Transformers model gets its own copy of its config.

Transformers dispatches attention and experts through the config (``config._attn_implementation``,
``config._experts_implementation``), and models built from one config object share it:
``AutoModelForCausalLM.from_config(cfg)`` twice gives ``a.config is b.config``, and so do a stock
model and its kernelized copy, a teacher and its student, a PEFT model and its base. Switching
``b``'s implementation on a shared config would make ``a`` dispatch to kernel-hub's functions
without kernelize's per-module checks. So before kernelize switches anything, every config object
the model's modules hold (the model's own, and sub-configs such as ``text_config`` that
submodules hold) is replaced by a copy that only this model holds; the copies keep their sharing
within the model (``model.config is model.model.config`` stays true). The copy stays after
``unkernelize`` (its values are then the stock ones), and a later kernelize of the same model
reuses it. Code that kept a reference to the original config object no longer reaches the
kernelized model through it: read ``model.config``.
"""

from __future__ import annotations

import copy

import torch
from transformers import PretrainedConfig

OWN_CONFIG_ATTRIBUTE = "_kernel_hub_own_config"
"""Instance attribute of a kernelized model: the config copy kernelize made for it."""


def give_own_config(model: torch.nn.Module) -> None:
    """Replace each config object held by ``model``'s modules with a copy private to ``model``
    (one copy per original object, so sharing inside the model is kept)."""
    config = model.__dict__.get("config")
    if config is not None and model.__dict__.get(OWN_CONFIG_ATTRIBUTE) is config:
        return  # already private: a second kernelize keeps the copy the first one made
    copies: dict[int, object] = {}  # deepcopy memo shared by every module: one copy per object
    for module in model.modules():
        for name, value in list(module.__dict__.items()):
            if isinstance(value, PretrainedConfig):
                module.__dict__[name] = copy.deepcopy(value, copies)
    if "config" in model.__dict__:
        model.__dict__[OWN_CONFIG_ATTRIBUTE] = model.__dict__["config"]
