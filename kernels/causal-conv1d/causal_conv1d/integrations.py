"""Transformers: the ``causal_conv1d_fn`` / ``causal_conv1d_update`` function slots of the hybrid
mixers (Qwen3-Next's fallbacks' signatures and layouts: channels first, ``[B, D, T]``; the conv
state ``[B, D, S]``, updated in place).

kernelize fills them on the modules of a kernel layer that reads them from its module
(``GatedDeltaNet``); see ``kernel_hub.layers.integrations.function_slots``. As in Transformers'
fallbacks the convolution runs in the weight's dtype and returns the input's.
"""

from __future__ import annotations

import torch

from . import api

causal_conv1d = api.causal_conv1d.torch
causal_conv1d_update = api.causal_conv1d_update.torch

has_backward = True  # causal_conv1d is differentiable; the decode update runs without gradients
can_torch_compile = False
module_problem = None  # the layers reading the slots check their own modules


def register() -> dict:
    """The functions kernelize puts in the slots."""
    return {"causal_conv1d_fn": causal_conv1d_fn, "causal_conv1d_update": causal_conv1d_update_fn}


def causal_conv1d_fn(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
) -> torch.Tensor:
    """Depthwise causal convolution of ``hidden_states`` ``[B, D, T]`` with ``weight``
    ``[D, W]``, then ``activation``; ``[B, D, T]``."""
    x = hidden_states.transpose(1, 2).to(weight.dtype)
    y = causal_conv1d(x, weight, bias, activation=activation)
    return y.transpose(1, 2).to(hidden_states.dtype)


def causal_conv1d_update_fn(
    hidden_states: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
) -> torch.Tensor:
    """A decode step: ``hidden_states`` ``[B, D, T]`` after the inputs in ``conv_state``
    ``[B, D, S]``, which is overwritten with the last S inputs; returns ``[B, D, T]``."""
    x = hidden_states.transpose(1, 2).to(weight.dtype)
    y, state = causal_conv1d_update(
        x, conv_state.transpose(1, 2), weight, bias, activation=activation
    )
    conv_state.copy_(state.transpose(1, 2))
    return y.transpose(1, 2).to(hidden_states.dtype)
